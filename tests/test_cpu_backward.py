"""`for_xla_cpu`: the same gradients as `jax.grad`, no weight-gradient dot left
for XLA:CPU to fold into one its fast kernels refuse, and checkpointed blocks
that XLA can no longer merge with their forward pass (the memory saving
itself: test_gpt.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpax.models import gpt
from dpax.xla_cpu.backward import for_xla_cpu


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _lhs_first_dim_dots(hlo: str) -> int:
    """Dots that contract their lhs's first dimension: what algsimp makes of
    transpose(dot) (YNNPACK refuses them)."""
    return len(re.findall(r" dot\(.*lhs_contracting_dims=\{0", hlo))


def _instructions(hlo: str) -> list[str]:
    """Each HLO instruction's shape (with layout) and opcode, names and metadata left out."""
    return re.findall(r"= (\S+) ([a-z-]+)\(", hlo)


def _windowed_ops(hlo: str) -> set[str]:
    """HLO ops over windows or scattering into them (XLA expands a
    select-and-scatter into a reduce-window and a scatter)."""
    return set(re.findall(r" ([a-z-]*(?:window|scatter)[a-z-]*)\(", hlo))


def _dense_loss(ws, x):  # dense layers on [batch, tokens, features], as in a transformer
    for w in ws:
        x = jnp.tanh(x @ w)
    return x.sum()


def test_weight_gradients_keep_their_values_and_lose_the_folded_dots():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    ws = [jax.random.normal(k1, (24, 48)) / 5, jax.random.normal(k2, (48, 16)) / 7]
    x = jax.random.normal(k3, (8, 12, 24))
    plain, kept = jax.grad(_dense_loss), for_xla_cpu(jax.grad(_dense_loss))
    for a, b in zip(plain(ws, x), kept(ws, x)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert _lhs_first_dim_dots(_compiled(plain, ws, x)) == 2  # one per kernel: folded
    assert _lhs_first_dim_dots(_compiled(kept, ws, x)) == 0


def test_a_checkpointed_gpt_gradient_is_unchanged():
    """Nested jits and checkpointed blocks' backward passes are rewritten too:
    a checkpointed block recomputes inside a conditional."""
    model = gpt.GPT(256, 16, layers=2, width=32, heads=2, remat="block", rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
        return optax.softmax_cross_entropy_with_integer_labels(m(x[:, :-1]), x[:, 1:]).mean()

    x = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
    plain, kept = jax.grad(loss), for_xla_cpu(jax.grad(loss))
    for a, b in zip(jax.tree.leaves(plain(params, x)), jax.tree.leaves(kept(params, x))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    hlo = _compiled(kept, params, x)
    assert _lhs_first_dim_dots(_compiled(plain, params, x)) > 0
    assert _lhs_first_dim_dots(hlo) == 0
    assert hlo.count(" conditional(") == 2  # one per block


def test_a_model_the_rewrite_cannot_take_trains_without_it(monkeypatch):
    def refuse(*args):
        raise NotImplementedError("a primitive it does not know")

    monkeypatch.setattr("dpax.xla_cpu.backward._eval", refuse)
    ws = [jnp.ones((4, 6)) / 3]
    x = jnp.ones((2, 3, 4))
    with pytest.warns(UserWarning, match="training without it"):
        got = for_xla_cpu(jax.grad(_dense_loss))(ws, x)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(jax.grad(_dense_loss)(ws, x)[0]))


def test_a_transposed_literal_is_left_as_it_is():
    def f(w):  # a scalar constant transposed: a jaxpr Literal, not a dot's result
        return jax.lax.transpose(2.0, ()) * jnp.sum(w)

    w = jnp.arange(3.0)
    assert float(for_xla_cpu(f)(w)) == float(f(w))


def test_a_2d_dense_gradient_is_left_to_xla():
    """On [batch, features] the weight gradient's dot contracts one dimension:
    its folded form is the faster one on XLA:CPU, so the program is unchanged."""
    ws = [jnp.ones((24, 48)) / 5, jnp.ones((48, 16)) / 7]
    x = jnp.ones((8, 24))
    plain, kept = jax.grad(_dense_loss), for_xla_cpu(jax.grad(_dense_loss))
    # The same instructions; the barrier would have left each weight gradient
    # in a transposed layout and added a copy of it after its dot.
    assert _instructions(_compiled(kept, ws, x)) == _instructions(_compiled(plain, ws, x))


@pytest.mark.parametrize("shape,window,kind", [
    ((4, 9, 7, 3), (1, 2, 2, 1), "max"),  # odd sides: the last row/column is in no window
    ((2, 6, 6, 2), (1, 3, 2, 1), "max"),
    ((3, 10, 4), (1, 3, 1), "min"),
    ((5, 12), (1, 4), "max")])
def test_non_overlapping_pools_and_their_gradients_keep_their_bits(shape, window, kind):
    """Rewritten into reshapes and a one-hot choice: the same outputs and
    gradients as `reduce_window` and `select_and_scatter_add`, ties (integer
    inputs) going to the first element of the window, as XLA defines it."""
    init, op = (-jnp.inf, jax.lax.max) if kind == "max" else (jnp.inf, jax.lax.min)

    def loss(x):
        y = jax.lax.reduce_window(x, init, op, window, window, "VALID")
        return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)), y

    rng = np.random.default_rng(0)
    for x in (rng.integers(-2, 3, shape).astype(np.float32),
              rng.normal(size=shape).astype(np.float32)):
        plain, kept = jax.grad(loss, has_aux=True), for_xla_cpu(jax.grad(loss, has_aux=True))
        for a, b in zip(plain(x), kept(x)):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        assert not _windowed_ops(_compiled(kept, x))
        assert _windowed_ops(_compiled(plain, x))  # XLA's own: a windowed loop and a scatter


def test_an_overlapping_pool_is_left_to_xla():
    def loss(x):
        return nnx.max_pool(x, (3, 3), strides=(2, 2)).sum()

    x = jnp.ones((2, 9, 9, 1))
    assert _windowed_ops(_compiled(for_xla_cpu(jax.grad(loss)), x)) == {"reduce-window", "scatter"}
