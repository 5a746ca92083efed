"""Seed training tricks, compiled into the one step, keeping the promise:
gradient accumulation, bf16, clipping, the non-finite guard, dynamic batches."""

import collections
import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dpax
import reference
from dpax import data, losses, models
from dpax.collectives import PACK_MAX, psum_packed
from dpax.step import AXIS

STEPS = 10


@functools.cache
def digits():
    return data.digits()


def mlp():
    ds = digits()
    return models.MLP(ds.input_shape, ds.n_out, hidden=16, rngs=nnx.Rngs(0))


def trainer(n, tx=None, **kw):
    return dpax.Trainer(mlp(), losses.classification_loss, tx or optax.sgd(0.1), devices=n,
                        **kw)


def fit(t, batch_size, steps=STEPS, log_every=1):
    ds = digits()
    return t.fit(ds.x_train, ds.y_train, batch_size=batch_size, steps=steps, log_every=log_every)


def leaves(t):
    return jax.tree.leaves(t.params)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def plain_jit_params(tx, batches):
    return reference.plain_jit_params(mlp(), tx, batches)


def plan_batches(batch_size, steps=STEPS):
    ds = digits()
    plan = dpax.BatchPlan(len(ds.x_train), batch_size, seed=0)
    return [(ds.x_train[plan.indices(s)], ds.y_train[plan.indices(s)]) for s in range(steps)]


# -- gradient accumulation ---------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [64, 61])  # 61: not divisible by 2 x 4
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_two_devices_with_grad_accum_4_equal_one_device(batch_size, backend):
    ref = trainer(1)
    fit(ref, batch_size)
    acc = trainer(2, grad_accum=4, backend=backend)
    fit(acc, batch_size)
    diff = max_diff(leaves(acc), leaves(ref))
    print(f"grad-accum 4 on 2 devices ({backend}), batch {batch_size}: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    assert acc.traces["train"] == 1


def hlo_all_reduces(t, batch_size):
    """(count, bytes) of the all-reduce ops in the compiled training step."""
    size = t.padded(batch_size)
    ds = digits()
    batch = dpax.pad_batch({"x": ds.x_train[:batch_size], "y": ds.y_train[:batch_size]}, size)
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
    one = hlo_all_reduces(trainer(4), 64)
    four = hlo_all_reduces(trainer(4, grad_accum=4), 64)
    print(f"all-reduce ops/bytes: K=1 {one[:2]}, K=4 {four[:2]}")
    assert one[0] >= 1 and (one[0], one[1]) == (four[0], four[1])


def test_psum_packed_sums_like_psum_in_one_buffer_per_dtype():
    """The step's all-reduce: small leaves packed per dtype, large ones as they are."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (AXIS,))
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(4, 3, 5)).astype(np.float32),
            "b": rng.normal(size=(4,)).astype(np.float32),
            "c": rng.integers(-9, 9, (4, 7)).astype(np.int32),
            "h": rng.normal(size=(4, 2)).astype(jnp.bfloat16),
            "big": rng.normal(size=(4, PACK_MAX + 1)).astype(np.float32)}

    def reduce(fn):
        mapped = jax.shard_map(lambda t: fn(jax.tree.map(lambda x: x[0], t), AXIS), mesh=mesh,
                               in_specs=P(AXIS), out_specs=P())
        return jax.jit(mapped)(tree), jax.jit(mapped).lower(tree).as_text()

    for i in range(5):
        tree[f"small{i}"] = rng.normal(size=(4, i + 1)).astype(np.float32)
    packed, text = reduce(psum_packed)
    plain, plain_text = reduce(jax.lax.psum)
    for k in tree:
        assert packed[k].dtype == plain[k].dtype and packed[k].shape == plain[k].shape
        np.testing.assert_array_equal(np.asarray(packed[k], np.float32),
                                      np.asarray(plain[k], np.float32))
    def all_reduces(text):  # JAX emits one per buffer; XLA may combine them later
        return len(re.findall(r'"stablehlo.all_reduce"', text))

    assert all_reduces(plain_text) == len(tree) == 10
    assert all_reduces(text) == 4  # packed f32, s32 and bf16, and the big leaf


# -- bf16 --------------------------------------------------------------------------------
def lowered_all_reduce_elements(t, batch_size):
    """{dtype: elements} all-reduced by the step as dpax emits it (StableHLO)."""
    size = t.padded(batch_size)
    ds = digits()
    batch = dpax.pad_batch({"x": ds.x_train[:batch_size], "y": ds.y_train[:batch_size]}, size)
    text = t.lower_train_step(batch, size).as_text()
    elements = collections.Counter()
    for types in re.findall(r'"stablehlo.all_reduce"\(.*?\}\) : \((.*?)\) ->', text, re.S):
        for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", types):
            elements[dtype] += int(np.prod([int(d) for d in dims.split("x") if d]))
    return elements


def test_bf16_all_reduce_shows_in_the_hlo():
    n_params = sum(np.size(p) for p in jax.tree.leaves(nnx.state(mlp(), nnx.Param)))
    fp32 = lowered_all_reduce_elements(trainer(4), 64)
    bf16 = lowered_all_reduce_elements(trainer(4, allreduce_dtype="bf16"), 64)
    print(f"elements all-reduced: fp32 run {dict(fp32)}, bf16 run {dict(bf16)}")
    assert set(fp32) == {"f32"} and fp32["f32"] > n_params
    # Every gradient goes as bf16; the loss, count and metric sums stay f32.
    assert bf16["bf16"] == n_params and bf16["f32"] == fp32["f32"] - n_params


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
def test_clipping_on_4_devices_equals_optax_clip_on_one():
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    t = trainer(4, tx=tx)
    rows = fit(t, 61)
    assert min(r["grad_norm"] for r in rows) > 0.05  # the clip really acted every step
    ref = plain_jit_params(tx, plan_batches(61))
    assert max_diff(leaves(t), ref) <= 1e-5


# -- non-finite guard --------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_a_nan_batch_is_skipped_on_every_replica(backend):
    good = plan_batches(40, steps=4)
    nan = (good[1][0].copy(), good[1][1])
    nan[0][3] = np.nan
    stream = [good[0], nan, good[1], good[2], good[3]]
    t = trainer(4, backend=backend)
    rows = t.fit_stream(({"x": x, "y": y} for x, y in stream), log_every=5)
    assert rows[0]["skipped"] == 1 and rows[0]["examples"] == 160  # 4 good batches of 40
    assert dpax.replicas_in_sync(t.state)
    ref = plain_jit_params(optax.sgd(0.1), good)
    assert max_diff(leaves(t), ref) <= 1e-5


def test_too_many_bad_steps_exit_3_and_keep_the_last_good_params(tmp_path):
    out = tmp_path / "diverged"
    r = subprocess.run([sys.executable, "-m", "dpax", "train", "--devices", "2", "--optimizer",
                        "sgd", "--lr", "1e20", "--steps", "40", "--log-every", "5",
                        "--max-bad-steps", "5", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    assert "in a row" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with np.load(out / "params.npz") as p:
        assert all(np.isfinite(p[k]).all() for k in p.files)


# -- dynamic batch sizes -----------------------------------------------------------------
def test_random_batch_sizes_compile_once_per_bucket_and_equal_one_device():
    ds = digits()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(24):  # the unpadded reference compiles once per size
        idx = rng.choice(len(ds.x_train), size=int(rng.integers(1, 301)), replace=False)
        batches.append((ds.x_train[idx], ds.y_train[idx]))
    buckets = [64, 128, 256, 320]
    t = trainer(8)
    t.fit_stream(({"x": x, "y": y} for x, y in batches), buckets=buckets, log_every=24)
    assert t.traces["train"] in range(1, len(buckets) + 1)
    default = trainer(8)
    default.fit_stream(({"x": x, "y": y} for x, y in batches), log_every=24)
    assert default.traces["train"] <= 7  # buckets 8, 16, ..., 512 cover sizes 1..300
    ref = plain_jit_params(optax.sgd(0.1), batches)
    diff = max(max_diff(leaves(t), ref), max_diff(leaves(default), ref))
    print(f"dynamic batches vs unpadded single-device jit: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def test_buckets_must_fit_the_devices():
    with pytest.raises(dpax.DpaxError, match="multiple of 8"):
        trainer(4, grad_accum=2).fit_stream(iter([]), buckets=[12])


def test_grad_accum_cuts_peak_activation_memory():
    """XLA's own memory analysis of the compiled step: temp buffers shrink ~K-fold."""
    ds = digits()
    temp = {}
    for k in (1, 4):
        model = dpax.make_model("cnn", ds.input_shape, ds.n_out, seed=0)
        t = dpax.Trainer(model, losses.classification_loss, optax.sgd(0.1), devices=2,
                         grad_accum=k)
        size = t.padded(512)
        batch = dpax.pad_batch({"x": ds.x_train[:512], "y": ds.y_train[:512]}, size)
        compiled = t.lower_train_step(batch, size).compile()
        temp[k] = compiled.memory_analysis().temp_size_in_bytes
    print(f"step temp memory: K=1 {temp[1] / 2**20:.1f} MiB, K=4 {temp[4] / 2**20:.1f} MiB")
    assert temp[4] < 0.4 * temp[1]


# -- steps per call ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_eight_steps_per_call_equal_one_per_call(backend):
    one, eight = trainer(4, backend=backend), trainer(4, backend=backend, steps_per_call=8)
    rows1, rows8 = fit(one, 61, steps=20, log_every=4), fit(eight, 61, steps=20, log_every=4)
    assert max_diff(leaves(eight), leaves(one)) <= 1e-6
    assert eight.traces["train_multi"] == 1  # steps 1-16 in two calls, 17-20 one by one
    # Logs land on call boundaries; their means cover exactly the steps since the last.
    assert [r["step"] for r in rows8] == [8, 16, 20]
    assert sum(r["examples"] for r in rows8) == sum(r["examples"] for r in rows1) == 20 * 61


# -- metric sums -------------------------------------------------------------------------
def test_a_log_over_several_device_sums_equals_the_per_step_logs(monkeypatch):
    """The step adds its metrics into sums on the device; the host takes them
    over every STEPS_PER_SUM steps (here 3) and combines them at the log."""
    monkeypatch.setattr(dpax.trainer, "STEPS_PER_SUM", 3)
    per_step = fit(trainer(4), 61, log_every=1)
    (row,) = fit(trainer(4), 61, log_every=STEPS)
    examples = np.array([r["examples"] for r in per_step])
    assert row["examples"] == examples.sum() == STEPS * 61
    for key in ("loss", "accuracy"):
        mean = np.dot([r[key] for r in per_step], examples) / examples.sum()
        assert abs(row[key] - mean) <= 1e-6 * abs(mean), key
    assert row["grad_norm"] == per_step[-1]["grad_norm"]  # not a sum: the last step's
    assert row["skipped"] == 0


# -- ZeRO-1 ------------------------------------------------------------------------------
def opt_bytes_on_first_device(t):
    first = t.backend.devices[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(t.state.opt_state)
               for s in x.addressable_shards if s.device == first)


@pytest.mark.parametrize("name,tx", [("momentum", optax.sgd(0.05, momentum=0.9)),
                                     ("adam", optax.adam(3e-3))])
def test_sharded_optimizer_state_equals_replicated(name, tx):
    rep, zero = trainer(8, tx=tx), trainer(8, tx=tx, shard_optimizer_state=True)
    curve_rep = [r["loss"] for r in fit(rep, 61)]
    curve_zero = [r["loss"] for r in fit(zero, 61)]
    diff = max_diff(leaves(zero), leaves(rep))
    rel = max(abs(a - b) / a for a, b in zip(curve_rep, curve_zero))
    ratio = opt_bytes_on_first_device(zero) / (opt_bytes_on_first_device(rep) / 8)
    print(f"ZeRO-1 {name}: params {diff:.2e}, loss curve rel {rel:.2e}, "
          f"optimizer bytes/device = {ratio:.3f} x replicated/8")
    assert diff <= 1e-5 and rel <= 1e-5
    assert 0.9 <= ratio <= 1.1
    # Its checkpoint is device-count independent: resume on 3 devices.
    other = trainer(3, tx=tx, shard_optimizer_state=True)
    other.load_state_dict(zero.state_dict())
    rep.fit(digits().x_train, digits().y_train, batch_size=61, steps=STEPS + 3)
    other.fit(digits().x_train, digits().y_train, batch_size=61, steps=STEPS + 3)
    assert max_diff(leaves(other), leaves(rep)) <= 1e-5


# -- the training loop and Python's GC ---------------------------------------------------
def test_fit_leaves_the_gc_as_it_found_it():
    """The loop keeps pre-existing objects out of the cyclic collector and undoes
    that afterwards; a freeze the caller made stays."""
    import gc

    t = trainer(1)
    gc.unfreeze()
    during = []
    ds = digits()
    t.fit(ds.x_train, ds.y_train, batch_size=32, steps=2,
          on_step=lambda step: during.append(gc.get_freeze_count()))
    assert len(during) == 2 and min(during) > 0  # frozen while the loop ran
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.freeze()
    try:
        fit(t, 32, steps=4)
        assert gc.get_freeze_count() > 0  # unfreezing would have emptied it
    finally:
        gc.unfreeze()
