"""The generic path sums a transformer's weight gradients before their
transpose, where XLA's partitioner sums them: the same gradients, and no
weight-gradient dot folded with its transpose in the compiled step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

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
    # (a bf16 gradient's conversion kept); so does the narrow 2-D head's.
    assert [g.shape for g in grads] == [(48, 24), (16, 48), (3, 16)]
    assert [g.dtype for g in grads] == [jnp.float32] * 3
    assert [m is not None for m in reorder.moved] == [True, True, True]
    assert float(loss) == float(want_loss)
    # bf16: the moved head's dot feeds its conversion to f32 directly, and XLA
    # may then skip the bf16 rounding (`xla_allow_excess_precision`): within
    # one bf16 step of JAX's.
    rtol = 1e-5 if dtype == jnp.float32 else 2.0**-8
    for got, ref in zip(reorder.transposes(grads), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=rtol, atol=1e-6)


def test_nothing_to_move_runs_the_function_as_it_is():
    ws, x = _inputs()
    # 2-D and wider than NARROW (48 outputs): folded into a plain matmul, left alone.
    flat = x.reshape(-1, 24)
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


@pytest.mark.slow
def test_the_generic_step_has_no_folded_weight_gradient(monkeypatch):
    """On 2 devices with the tuning off: the GPT's four dense layers' weight
    gradients are dots that XLA did not fold (their all-reduce sits between);
    without the move, they are folded."""
    assert _folded_dots(_transformer_step_hlo()) == 0
    # The step as it was: every gradient summed as JAX gives it.
    monkeypatch.setattr(untransposed, "_untransposed",
                        lambda jaxpr, n: (list(jaxpr.outvars), [None] * n, [False] * n))
    assert _folded_dots(_transformer_step_hlo()) >= 4


@pytest.mark.parametrize("outputs, moved", [(untransposed.NARROW, True),
                                             (untransposed.NARROW + 1, False)])
def test_a_2d_layer_is_moved_only_when_narrow(outputs, moved):
    x = jax.random.normal(jax.random.key(1), (8, 24))
    w = [jax.random.normal(jax.random.key(2), (24, outputs))]
    reorder = ReduceBeforeTranspose()
    _, grads = jax.jit(reorder.wrap(jax.value_and_grad(lambda w: jnp.tanh(x @ w[0]).sum())))(w)
    assert (reorder.moved[0] is not None) == moved
    assert grads[0].shape == ((outputs, 24) if moved else (24, outputs))


def _dot_shapes(hlo: str) -> list[str]:
    return re.findall(r"= f32\[([0-9,]+)\]\S* dot\(", hlo)


def _head_dot_shapes(devices: int, hidden: int = 48, rows: int = 8, **options) -> list[str]:
    t = dpax.Trainer(dpax.models.MLP((64,), 10, hidden=(hidden,), rngs=nnx.Rngs(0)),
                     dpax.models.losses.classification_loss, optax.adam(1e-3),
                     devices=devices, xla_cpu_tuning=False, **options)
    x = np.random.default_rng(0).normal(size=(rows, 64)).astype(np.float32)
    host = {"x": x, "y": np.arange(rows, dtype=np.int32) % 10, "mask": np.ones(rows, bool)}
    return _dot_shapes(t.lower_train_step(host, rows).compile().as_text())


def test_the_generic_step_sums_a_narrow_head_before_its_transpose():
    """A classifier's head (48 -> 10) on 2 devices: its weight gradient is
    the [10, 48] dot, summed, then transposed (jit's partitioner's form), not
    the folded [48, 10] dot; the wide hidden layer (64 -> 48) stays folded."""
    shapes = _head_dot_shapes(2)
    assert "10,48" in shapes and "48,10" not in shapes
    assert "64,48" in shapes  # folded: the param's own shape


@pytest.mark.slow
def test_on_one_device_the_guards_norm_keeps_a_large_head_unfolded():
    """One device, no all-reduce between the head's dot and its transpose:
    the guard's norm reads the [10, 1024] dot itself (128 x 1024 x 10
    multiply-adds, >= HEAD_MACS), so XLA cannot fold the two. Without the
    guard nothing reads it, and XLA folds them as in a jit loop; a head below
    HEAD_MACS is left folded too. The wide layer is folded either way."""
    assert 128 * 1024 * 10 >= untransposed.HEAD_MACS > 8 * 48 * 10
    shapes = _head_dot_shapes(1, hidden=1024, rows=128, skip_nonfinite=True)
    assert "10,1024" in shapes and "1024,10" not in shapes and "64,1024" in shapes
    shapes = _head_dot_shapes(1, hidden=1024, rows=128)
    assert "1024,10" in shapes and "10,1024" not in shapes
    shapes = _head_dot_shapes(1, skip_nonfinite=True)
    assert "48,10" in shapes and "10,48" not in shapes


@pytest.mark.parametrize("devices", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_the_clipped_norm_over_an_unfolded_head_is_optax_clip(devices):
    """The norm that clips (and guards) reads a large head's gradient
    untransposed on one device (61 x 2048 x 10 multiply-adds >= HEAD_MACS):
    the same global norm, so the same params as optax's own
    clip_by_global_norm in a jit loop, on 1 and 4 devices."""
    import reference
    from conftest import STEPS, digits, fit_digits, leaves, plan_batches

    assert 61 * 2048 * 10 >= untransposed.HEAD_MACS
    ds = digits()

    def model():
        return dpax.models.MLP(ds.input_shape, ds.n_out, hidden=2048, rngs=nnx.Rngs(0))

    t = dpax.Trainer(model(), dpax.classification_loss, optax.sgd(0.1), devices=devices,
                     clip_norm=0.05, xla_cpu_tuning=False)
    rows = fit_digits(t, 61)
    assert min(r["grad_norm"] for r in rows) > 0.05  # the clip acted every step
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    ref = reference.plain_jit_params(model(), tx, plan_batches(61, STEPS))
    assert max_diff(leaves(t), ref) <= 1e-5


@pytest.mark.slow
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
