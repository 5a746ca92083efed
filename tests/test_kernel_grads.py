"""`keep_untransposed`: the same gradients, and no weight-gradient dot left for
XLA:CPU to fold into one its fast kernels refuse (the reference: `jax.grad`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpax import gpt
from dpax.kernel_grads import keep_untransposed


def _lhs_first_dim_dots(f, *args) -> int:
    """Dots in the compiled program that contract their lhs's first dimension:
    what algsimp makes of transpose(dot) (YNNPACK refuses them)."""
    text = jax.jit(f).lower(*args).compile().as_text()
    return len(re.findall(r" dot\(.*lhs_contracting_dims=\{0", text))


def _dense_loss(ws, x):  # dense layers on [batch, tokens, features], as in a transformer
    for w in ws:
        x = jnp.tanh(x @ w)
    return x.sum()


def test_weight_gradients_keep_their_values_and_lose_the_folded_dots():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    ws = [jax.random.normal(k1, (24, 48)) / 5, jax.random.normal(k2, (48, 16)) / 7]
    x = jax.random.normal(k3, (8, 12, 24))
    plain, kept = jax.grad(_dense_loss), keep_untransposed(jax.grad(_dense_loss))
    for a, b in zip(plain(ws, x), kept(ws, x)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert _lhs_first_dim_dots(plain, ws, x) == 2  # one per kernel: the fold happens
    assert _lhs_first_dim_dots(kept, ws, x) == 0


@pytest.mark.parametrize("remat", ["none", "block"])
def test_a_gpt_gradient_is_unchanged_with_or_without_remat(remat):
    """Nested jits and checkpointed blocks' backward passes are rewritten too."""
    model = gpt.GPT(256, 16, layers=2, width=32, heads=2, remat=remat, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
        return optax.softmax_cross_entropy_with_integer_labels(m(x[:, :-1]), x[:, 1:]).mean()

    x = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
    plain, kept = jax.grad(loss), keep_untransposed(jax.grad(loss))
    for a, b in zip(jax.tree.leaves(plain(params, x)), jax.tree.leaves(kept(params, x))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    assert _lhs_first_dim_dots(plain, params, x) > 0
    assert _lhs_first_dim_dots(kept, params, x) == 0
