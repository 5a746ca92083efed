"""The generic path sums a transformer's weight gradients before their
transpose, where XLA's partitioner sums them: the same gradients, and no
weight-gradient dot folded with its transpose in the compiled step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpax
from conftest import max_diff
from dpax.training import untransposed
from dpax.training.untransposed import ReduceBeforeTranspose


def _loss(ws, x, dtype=jnp.float32):
    """Dense layers on [batch, tokens, features] (a transformer's), then one on
    [batch, features] (a classifier head's)."""
    h = x.astype(dtype)
    for w in ws[:-1]:
        h = jnp.tanh(h @ w.astype(dtype))
    return (h.mean(axis=1) @ ws[-1].astype(dtype)).astype(jnp.float32).sum()


def _inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    ws = [jax.random.normal(k1, (24, 48)) / 5, jax.random.normal(k2, (48, 16)) / 7,
          jax.random.normal(k3, (16, 3)) / 4]
    return ws, jax.random.normal(k4, (8, 12, 24))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_come_back_untransposed_and_transpose_to_jaxs(dtype):
    ws, x = _inputs()
    grad_fn = jax.value_and_grad(lambda w: _loss(w, x, dtype))
    reorder = ReduceBeforeTranspose()
    loss, grads = jax.jit(reorder.wrap(grad_fn))(ws)
    want_loss, want = jax.jit(grad_fn)(ws)
    # The two 3-D layers' gradients come back [out, in], in the params' dtype
    # (a bf16 gradient's conversion kept); the head's ([batch, features]) as JAX gives it.
    assert [g.shape for g in grads] == [(48, 24), (16, 48), (16, 3)]
    assert [g.dtype for g in grads] == [jnp.float32] * 3
    assert [m is not None for m in reorder.moved] == [True, True, False]
    assert float(loss) == float(want_loss)
    for got, ref in zip(reorder.transposes(grads), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_nothing_to_move_runs_the_function_as_it_is():
    ws, x = _inputs()
    flat = x.reshape(-1, 24)  # 2-D only: folded into a plain matmul, left alone
    grad_fn = jax.grad(lambda w: jnp.tanh(flat @ w[0]).sum())
    reorder, first = ReduceBeforeTranspose(), ws[:1]
    assert str(jax.make_jaxpr(reorder.wrap(grad_fn))(first)) == str(
        jax.make_jaxpr(grad_fn)(first))
    assert reorder.moved == [None]
    assert reorder.transposes(first) is first


def _folded_dots(hlo: str) -> int:
    """Dots contracting their lhs's first dimension: what XLA's algebraic
    simplifier makes of transpose(dot) when nothing sits between them."""
    return len(re.findall(r" dot\(.*lhs_contracting_dims=\{0", hlo))


def _gpt():
    return dpax.models.make_model("gpt", (17,), 64, 0, "lm", layers=1, width=32, heads=2)


def _windows(n: int) -> dict:
    x = np.random.default_rng(0).integers(0, 64, (n, 17)).astype(np.int32)
    return {"x": x, "y": np.full(n, 17, np.int32)}


def _transformer_step_hlo() -> str:
    t = dpax.Trainer(_gpt(), dpax.models.losses.lm_loss, optax.adam(1e-3), devices=2,
                     xla_cpu_tuning=False)
    host = {**_windows(8), "mask": np.ones(8, bool)}
    return t.lower_train_step(host, 8).compile().as_text()


def test_the_generic_step_has_no_folded_weight_gradient(monkeypatch):
    """On 2 devices with the tuning off: the GPT's four dense layers' weight
    gradients are dots that XLA did not fold (their all-reduce sits between);
    without the move, they are folded."""
    assert _folded_dots(_transformer_step_hlo()) == 0
    # The step as it was: every gradient summed as JAX gives it.
    monkeypatch.setattr(untransposed, "_untransposed",
                        lambda jaxpr, n: (list(jaxpr.outvars), [None] * n))
    assert _folded_dots(_transformer_step_hlo()) >= 4


def test_grad_accumulation_moves_every_micro_batch_alike():
    """Micro-batches summed in a scan are summed untransposed and moved back
    once: 2 devices x 2 micro-batches give one device's params (tuning off,
    the path that moves them). SGD: Adam's per-element normalization makes an
    lr-sized step of any rounding in a near-zero gradient element."""
    data = _windows(24)
    params = []
    for n in (1, 2):
        t = dpax.Trainer(_gpt(), dpax.models.losses.lm_loss, optax.sgd(0.5), devices=n,
                         grad_accum=2, xla_cpu_tuning=False)
        t.fit(data["x"], data["y"], batch_size=12, until_step=4, log_every=4)
        params.append(t.params)
    assert max_diff(*params) < 1e-5
