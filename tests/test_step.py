"""The per-device training step (`dpax.training.step`): gradient accumulation, bf16,
clipping and the non-finite guard, compiled into the one step, keeping the
promise (N devices give one device's params)."""

import collections
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import (
    digits,
    fit_digits,
    leaves,
    max_diff,
    mlp_trainer,
    plain_jit_params,
    plan_batches,
    small_mlp,
)
from dpax.data.batches import pad_batch
from dpax.models import losses
from dpax.training import hooks
from dpax.training.checkpoint import Checkpointer


# -- gradient accumulation ---------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [64, 61])  # 61: not divisible by 2 x 4
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_two_devices_with_grad_accum_4_equal_one_device(batch_size, backend):
    ref = mlp_trainer(1)
    fit_digits(ref, batch_size)
    acc = mlp_trainer(2, grad_accum=4, backend=backend)
    fit_digits(acc, batch_size)
    diff = max_diff(leaves(acc), leaves(ref))
    print(f"grad-accum 4 on 2 devices ({backend}), batch {batch_size}: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    assert acc.traces["train"] == 1


def hlo_all_reduces(t, batch_size):
    """(count, bytes) of the all-reduce ops in the compiled training step."""
    size = t.padded(batch_size)
    ds = digits()
    batch = pad_batch({"x": ds.x_train[:batch_size], "y": ds.y_train[:batch_size]}, size)
    text = t.lower_train_step(batch, size).compile().as_text()
    ops = [ln for ln in text.splitlines() if re.search(r"\ball-reduce(-start)?\(", ln)]
    width = {"f32": 4, "bf16": 2, "s32": 4, "f64": 8}
    total = 0
    for ln in ops:
        result = ln.split("=", 1)[1].split("all-reduce")[0]
        for dt, dims in re.findall(r"(f32|bf16|s32|f64)\[([\d,]*)\]", result):
            total += width[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return len(ops), total, text


def test_grad_accum_does_not_multiply_the_all_reduces():
    one = hlo_all_reduces(mlp_trainer(4), 64)
    four = hlo_all_reduces(mlp_trainer(4, grad_accum=4), 64)
    print(f"all-reduce ops/bytes: K=1 {one[:2]}, K=4 {four[:2]}")
    assert one[0] >= 1 and (one[0], one[1]) == (four[0], four[1])


@pytest.mark.slow
def test_grad_accum_cuts_peak_activation_memory():
    """XLA's own memory analysis of the compiled step: temp buffers shrink ~K-fold."""
    ds = digits()
    temp = {}
    for k in (1, 4):
        model = dpax.make_model("cnn", ds.input_shape, ds.n_out, seed=0)
        t = dpax.Trainer(model, losses.classification_loss, optax.sgd(0.1), devices=2,
                         grad_accum=k)
        size = t.padded(512)
        batch = pad_batch({"x": ds.x_train[:512], "y": ds.y_train[:512]}, size)
        compiled = t.lower_train_step(batch, size).compile()
        temp[k] = compiled.memory_analysis().temp_size_in_bytes
    print(f"step temp memory: K=1 {temp[1] / 2**20:.1f} MiB, K=4 {temp[4] / 2**20:.1f} MiB")
    assert temp[4] < 0.4 * temp[1]


# -- bf16 --------------------------------------------------------------------------------
def lowered_all_reduce_elements(t, batch_size):
    """{dtype: elements} all-reduced by the step as dpax emits it (StableHLO)."""
    size = t.padded(batch_size)
    ds = digits()
    batch = pad_batch({"x": ds.x_train[:batch_size], "y": ds.y_train[:batch_size]}, size)
    text = t.lower_train_step(batch, size).as_text()
    elements = collections.Counter()
    for types in re.findall(r'"stablehlo.all_reduce"\(.*?\}\) : \((.*?)\) ->', text, re.S):
        for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", types):
            elements[dtype] += int(np.prod([int(d) for d in dims.split("x") if d]))
    return elements


def test_bf16_all_reduce_shows_in_the_hlo():
    n_params = sum(np.size(p) for p in jax.tree.leaves(nnx.state(small_mlp(), nnx.Param)))
    fp32 = lowered_all_reduce_elements(mlp_trainer(4), 64)
    bf16 = lowered_all_reduce_elements(mlp_trainer(4, allreduce_dtype="bf16"), 64)
    print(f"elements all-reduced: fp32 run {dict(fp32)}, bf16 run {dict(bf16)}")
    assert set(fp32) == {"f32"} and fp32["f32"] > n_params
    # Every gradient goes as bf16; the loss, count and metric sums stay f32.
    assert bf16["bf16"] == n_params and bf16["f32"] == fp32["f32"] - n_params


@pytest.mark.slow
def test_bf16_trains_digits_with_fp32_params_close_to_fp32():
    ds = digits()

    def run(precision, allreduce):
        model = dpax.make_model("cnn", ds.input_shape, ds.n_out, seed=0)
        t = dpax.Trainer(model, losses.classification_loss, optax.adam(3e-3), devices=8,
                         precision=precision, allreduce_dtype=allreduce)
        rows = t.fit(ds.x_train, ds.y_train, batch_size=128, epochs=10, log_every=12)
        return t, np.array([r["loss"] for r in rows])

    t32, curve32 = run("fp32", "fp32")
    t16, curve16 = run("bf16", "bf16")
    assert all(a.dtype == np.float32 for a in leaves(t16))
    acc = t16.evaluate(ds.x_eval, ds.y_eval)["accuracy"]
    gap = float(np.max(np.abs(curve16 - curve32)))
    print(f"bf16 eval accuracy {acc:.3f}; loss curve max |bf16 - fp32| {gap:.3f}")
    assert acc >= 0.95
    assert gap <= 0.02  # per-epoch mean loss, from 2.3 down to ~0.03


# -- clipping ----------------------------------------------------------------------------
def test_clip_norm_on_4_devices_equals_optax_clip_on_one():
    t = mlp_trainer(4, clip_norm=0.05)  # sgd(0.1)
    rows = fit_digits(t, 61)
    assert min(r["grad_norm"] for r in rows) > 0.05  # the clip really acted every step
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    ref = plain_jit_params(tx, plan_batches(61))
    assert max_diff(leaves(t), ref) <= 1e-5


# -- non-finite guard --------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_a_nan_batch_is_skipped_on_every_replica(backend):
    good = plan_batches(40, steps=4)
    nan = (good[1][0].copy(), good[1][1])
    nan[0][3] = np.nan
    stream = [good[0], nan, good[1], good[2], good[3]]
    t = mlp_trainer(4, backend=backend, skip_nonfinite=True)
    rows = t.fit_stream(({"x": x, "y": y} for x, y in stream), log_every=5)
    assert rows[0]["skipped"] == 1 and rows[0]["examples"] == 160  # 4 good batches of 40
    assert dpax.pmap.replicas_in_sync(t.state)
    ref = plain_jit_params(optax.sgd(0.1), good)
    assert max_diff(leaves(t), ref) <= 1e-5


def test_a_batch_of_zero_weight_is_skipped_not_applied():
    """A global batch whose examples all weigh 0 (text windows with no target,
    say) has no mean gradient: 0/0. It is skipped like a NaN batch, where it
    used to pass the guard (finite sums) and write NaN params."""
    def weighted(model, batch):
        return (*dpax.classification_loss(model, batch), batch["w"])

    good = plan_batches(40, steps=4)
    stream = [{"x": x, "y": y, "w": np.ones(len(y), np.float32)} for x, y in good]
    empty = {**stream[1], "w": np.zeros(40, np.float32)}
    t = dpax.Trainer(small_mlp(), weighted, optax.sgd(0.1), devices=4, skip_nonfinite=True)
    rows = t.fit_stream(iter([stream[0], empty, *stream[1:]]), log_every=5)
    assert rows[0]["skipped"] == 1 and rows[0]["examples"] == 160
    assert max_diff(leaves(t), plain_jit_params(optax.sgd(0.1), good)) <= 1e-5


def test_by_default_every_step_is_applied_as_a_hand_loop_does(tmp_path, capsys):
    """The default, `skip_nonfinite=False`: the same params on finite data; a
    NaN step is applied (the params are then not finite), counted, and stops
    the run. Its
    state is never checkpointed: it would push the good checkpoints out of the
    newest `keep`, and the newest one holds the last good step."""
    good = plan_batches(40, steps=4)
    t = mlp_trainer(4, max_bad_steps=2)
    ckpt = Checkpointer(str(tmp_path), keep=2)
    every_step = hooks.Checkpoint(ckpt, t, None, {}, every=1)
    rows = t.fit_stream(({"x": x, "y": y} for x, y in good[:3]), log_every=4,
                        hooks=[every_step])
    assert max_diff(leaves(t), plain_jit_params(optax.sgd(0.1), good[:3])) <= 1e-5
    assert "grad_norm" not in rows[0]  # nothing computes it (the next test)

    class KeepStep4(dpax.Hook):
        def after_step(self, step):
            if step == 4:
                self.state = {k: np.asarray(v) for k, v in t.state_dict().items()}

    last_good = KeepStep4()
    nan = good[0][0].copy()
    nan[3] = np.nan
    # The first batch of a stream is checked (it would be refused): the NaN comes after.
    stream = [{"x": good[3][0], "y": good[3][1]}] + [{"x": nan, "y": good[0][1]}] * 4
    with pytest.raises(dpax.TooManyBadSteps, match="were applied"):
        t.fit_stream(iter(stream), log_every=1, hooks=[every_step, last_good])
    assert not all(np.isfinite(np.asarray(a)).all() for a in leaves(t))
    ckpt.manager.wait_until_finished()
    assert ckpt.steps() == [3, 4]
    assert "step 5 was not checkpointed" in capsys.readouterr().err
    step, state, _ = ckpt.restore(t.state_template(), None)
    assert step == 4 and all(np.array_equal(state[k], v) for k, v in last_good.state.items())
    ckpt.close()




@jax.custom_vjp
def _inf_gradient(x, bad):
    return x


_inf_gradient.defvjp(lambda x, bad: (x, bad),
                     lambda bad, g: (jnp.where(bad[:, None], jnp.inf, g), None))


def _finite_loss_inf_gradient(model, batch):
    """The classification loss, finite everywhere, with an inf gradient from
    the rows marked `bad`."""
    return dpax.classification_loss(lambda x: _inf_gradient(model(x), batch["bad"]), batch)


@pytest.mark.parametrize("skip", [True, False])
def test_a_finite_loss_with_an_inf_gradient(skip):
    """The guard skips it (its test is the gradient's sum of squares). Without
    the guard nothing reads the gradient: the step is applied, and the next
    step's loss, computed from the non-finite params, counts it."""
    good = plan_batches(40, steps=3)
    stream = [{"x": x, "y": y, "bad": np.zeros(40, bool)} for x, y in good]
    stream[1]["bad"][5] = True
    t = dpax.Trainer(small_mlp(), _finite_loss_inf_gradient, optax.sgd(0.1), devices=4,
                     skip_nonfinite=skip, max_bad_steps=None)
    rows = t.fit_stream(iter(stream), log_every=1)
    if skip:  # a skipped step adds nothing to the logged means
        assert [r["skipped"] for r in rows] == [0, 1, 0] and rows[1]["examples"] == 0
        ref = plain_jit_params(optax.sgd(0.1), [good[0], good[2]])
        assert max_diff(leaves(t), ref) <= 1e-5
    else:
        assert [r["skipped"] for r in rows] == [0, 0, 0]
        assert np.isfinite(rows[1]["loss"]) and not np.isfinite(rows[2]["loss"])
        assert not all(np.isfinite(np.asarray(a)).all() for a in leaves(t))
        assert int(t.state.bad_in_a_row) == 1

def gradient_reductions(t, batch_size=24):
    """The step's reductions to a scalar of the gradient's leaves: a large
    weight's own shape, or the one vector the small leaves are summed as
    (`sum_of_squares`; no loss or metric reduces such shapes)."""
    from dpax.training.update import SMALL_LEAF

    x, y = plan_batches(batch_size, steps=1)[0]
    text = t.lower_train_step({"x": x, "y": y, "mask": np.ones(batch_size, bool)}).as_text()
    params = leaves(t)
    small = sum(p.size for p in params if p.size <= SMALL_LEAF)
    shapes = {"x".join(map(str, p.shape)) for p in params if p.size > SMALL_LEAF}
    shapes |= {str(small)} if small else set()
    found = re.findall(r"stablehlo\.reduce.*: \(tensor<([\dx]+)xf32>, tensor<f32>\) -> "
                       r"tensor<f32>", text)
    return sorted(s for s in found if s in shapes), sorted(shapes)


@pytest.mark.slow
def test_without_the_guard_or_clipping_the_step_makes_no_pass_over_the_gradient():
    """By default the step does a hand loop's work: no sum of squares of the
    gradient (4-6% of the mlp's step on one CPU device), so no grad_norm. The
    guard, or clipping alone, computes it once: a reduction per large weight,
    one for the small leaves together."""
    assert gradient_reductions(mlp_trainer(1))[0] == []
    found, expected = gradient_reductions(mlp_trainer(1, skip_nonfinite=True))
    assert found == expected
    clipped = mlp_trainer(1, clip_norm=1.0)
    assert gradient_reductions(clipped)[0] == expected
    ds = digits()  # layers of 64 x 1100 and more > SMALL_LEAF: each reduced on its own
    wide = dpax.Trainer(dpax.models.MLP(ds.input_shape, ds.n_out, hidden=1100,
                                        rngs=nnx.Rngs(0)), dpax.classification_loss,
                        optax.sgd(0.1), devices=1, skip_nonfinite=True)
    found, expected = gradient_reductions(wide)
    assert found == expected and "64x1100" in expected and len(expected) >= 2


@pytest.mark.slow
@pytest.mark.processes  # starts dpax processes
def test_too_many_bad_steps_exit_3_and_keep_the_last_good_params(tmp_path):
    """With `--skip-nonfinite` the diverging steps are skipped: the run stops
    with exit 3 and params.npz holds the last good params."""
    out = tmp_path / "diverged"
    r = subprocess.run([sys.executable, "-m", "dpax", "train", "--devices", "2", "--optimizer",
                        "sgd", "--lr", "1e20", "--steps", "40", "--log-every", "5",
                        "--max-bad-steps", "5", "--skip-nonfinite", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    assert "in a row" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with np.load(out / "params.npz") as p:
        assert all(np.isfinite(p[k]).all() for k in p.files)
