"""`Trainer` (`dpax.training.trainer`): batches of any size through `fit_stream`; a
dropped Trainer frees its executables."""

import collections
import gc
import os
import subprocess
import sys
from typing import Any

import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import check_loss_cli, digits, leaves, max_diff, mlp_trainer, plain_jit_params


@pytest.mark.slow
# -- dynamic batch sizes -----------------------------------------------------------------
def test_random_batch_sizes_compile_once_per_bucket_and_equal_one_device():
    ds = digits()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(12):  # the unpadded reference compiles once per size
        idx = rng.choice(len(ds.x_train), size=int(rng.integers(1, 301)), replace=False)
        batches.append((ds.x_train[idx], ds.y_train[idx]))
    buckets = [64, 128, 256, 320]
    t = mlp_trainer(8)
    t.fit_stream(({"x": x, "y": y} for x, y in batches), buckets=buckets, log_every=12)
    assert t.traces["train"] in range(1, len(buckets) + 1)
    default = mlp_trainer(8)
    default.fit_stream(({"x": x, "y": y} for x, y in batches), log_every=12)
    assert default.traces["train"] <= 7  # buckets 8, 16, ..., 512 cover sizes 1..300
    ref = plain_jit_params(optax.sgd(0.1), batches)
    diff = max(max_diff(leaves(t), ref), max_diff(leaves(default), ref))
    print(f"dynamic batches vs unpadded single-device jit: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def test_buckets_must_fit_the_devices():
    with pytest.raises(dpax.DpaxError, match="multiple of 8"):
        mlp_trainer(4, grad_accum=2).fit_stream(iter([]), buckets=[12])


def _freed_when_dropped(kw: dict) -> list[str]:
    """Train, evaluate and predict with a Trainer, drop it, run the young
    collections: the types of what still refers to it or its steps (none)."""
    import gc
    import weakref

    ds = digits()
    t = mlp_trainer(2, optax.adam(1e-3), predict_fn=dpax.classification_predict, **kw)
    t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=4)
    t.evaluate(ds.x_eval, ds.y_eval)
    t.predict(ds.x_eval)
    freed = weakref.ref(t), weakref.ref(t._steps)
    del t
    gc.collect(1)  # the young generations only: what a full collection would find stays
    return [type(r).__name__ for ref in freed if ref() is not None
            for r in gc.get_referrers(ref())]


@pytest.mark.parametrize("kw", [{}, {"sharding": "full"},
                                pytest.param({"backend": "pmap"}, marks=pytest.mark.slow),
                                pytest.param({"steps_per_call": 2}, marks=pytest.mark.slow)],
                         ids=str)
def test_a_trainer_is_freed_when_dropped(kw):
    """No reference cycle keeps a Trainer and its compiled executables alive
    until a full collection: a sweep of hundreds of Trainers in one process
    ran out of memory maps for XLA's code (LLVM: cannot allocate memory).
    The slow variants run in a process of their own: in the slow tier's
    long pytest process, the pmap (b419e01) and steps_per_call (894ac4a,
    515c3b6) Trainers were still referred to after `del` by their loop's
    callbacks (bound methods and a closure), which no run of them alone
    shows, even with the Trainer in the oldest generation: what holds them
    there is not found yet. A Trainer that holds itself fails either way."""
    if kw in ({}, {"sharding": "full"}):
        assert _freed_when_dropped(kw) == []
        return
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest, test_trainer; "
            f"print(test_trainer._freed_when_dropped({kw!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def device_bytes(devices=None) -> int:
    """Bytes of the device buffers alive (on `devices`, or on any), each counted
    once: an array made as a view of another's shard (`np.asarray` of a
    replicated array) shares its buffer."""
    import jax

    buffers = {}
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            if devices is None or shard.device in devices:
                buffers[(shard.device, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return sum(buffers.values())


@pytest.mark.parametrize("kw", [{}, {"backend": "pmap"}, {"sharding": "full"}], ids=str)
def test_placing_the_state_holds_no_second_device_copy_of_it(kw, monkeypatch):
    """The optimizer state (Adam's: twice the params) and the EMA's copy are
    not made on the devices the state is placed on: on one H100 the Trainer's
    start, not the step, was a run's peak (benchmarks/README.md). As there,
    the model lives on the first of the Trainer's devices, not on the host's
    CPU device (here cpu:0); their live arrays are counted as placing starts."""
    import jax
    from flax import nnx

    from dpax.parallel import backends

    devices = jax.devices()[1:3]
    seen = []
    for cls in (backends.ShardMapBackend, backends.PmapBackend):
        put = cls.put_state

        def counting(self, *args, _put=put, **kwargs):
            seen.append(device_bytes(devices))
            return _put(self, *args, **kwargs)

        monkeypatch.setattr(cls, "put_state", counting)
    gc.collect()  # garbage freed during the Trainer's start would hide what it adds
    with jax.default_device(devices[0]):  # an accelerator's process: its first device
        model = dpax.models.MLP((64,), 10, hidden=(256,), rngs=nnx.Rngs(0))
        params = sum(x.nbytes for x in jax.tree.leaves(model))
        before = device_bytes(devices)
        assert before >= params  # the model's arrays are there
        dpax.Trainer(model, dpax.models.losses.classification_loss, optax.adam(1e-3),
                     devices=devices, ema_decay=0.9, **kw)
    # Adam's two moments and the EMA would be 3x the params (on each device
    # the model's are on); the step counters and the RNG key are what is left.
    assert seen[0] - before < 0.05 * params


def test_arrays_the_state_shares_with_their_owners_survive_training():
    """The step donates the state: the arrays it starts from that belong to
    someone else (a learning rate given as an array, which optax's init keeps
    in the optimizer state; the model's params and its RNG keys) are copies, so
    the owners keep them, and one optimizer trains a second Trainer alike."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 16, rngs=rngs), nnx.Linear(16, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.relu(self.a(x.reshape(x.shape[0], -1)))))

    lr = jnp.float32(0.05)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    ds = digits()
    params = []
    for _ in range(2):
        model = Dropped(nnx.Rngs(0))
        keys = [x for x in jax.tree.leaves(nnx.state(model)) if dpax.parallel.arrays.is_key(x)]
        assert keys  # the dropout's stream
        t = dpax.Trainer(model, dpax.classification_loss, tx, devices=2)
        t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=2)
        assert not lr.is_deleted() and float(lr) == np.float32(0.05)
        assert not any(k.is_deleted() for k in keys)
        params.append(t.params)
    assert max_diff(*params) == 0.0


def test_loading_a_state_frees_the_current_one_before_placing_it(monkeypatch):
    """A resume holds the restored state and the placed one, not also the
    state the Trainer started with (three copies: 2x a step's state memory)."""
    import jax

    from dpax.parallel import backends

    t = mlp_trainer(2, optax.adam(1e-3))
    held = sum(s.data.nbytes for x in t._leaves for s in x.addressable_shards)
    # Device arrays of the Trainer's shapes, as Orbax restores them; other values.
    restored = {k: jax.device_put(v + 1 if np.issubdtype(v.dtype, np.floating) else v,
                                  v.sharding, may_alias=False)
                for k, v in t.state_dict().items()}
    seen = []
    put = backends.ShardMapBackend.put_state

    def counting(self, *args, **kwargs):
        seen.append(device_bytes())
        return put(self, *args, **kwargs)

    monkeypatch.setattr(backends.ShardMapBackend, "put_state", counting)
    before = device_bytes()
    t.load_state_dict(restored)
    assert before - seen[0] > 0.95 * held
    loaded = t.state_dict()
    assert all(np.array_equal(loaded[k], v) for k, v in restored.items())


def test_a_checkpoint_is_read_as_the_layout_splits_it_after_the_state_is_freed(
        tmp_path, monkeypatch):
    """A fully sharded state is read straight onto the devices a quarter per
    device (each process its own shards: never whole in one process's memory,
    nor replicated onto every device first), after the Trainer's own state is
    freed (a refused checkpoint leaves it); a state dict of device arrays is
    copied, not taken: the step donates the state's buffers."""
    import jax

    from dpax.training.checkpoint import Checkpointer

    t = mlp_trainer(4, optax.adam(1e-3), sharding="full")
    # Leaves split evenly are saved as they are stored, a quarter per device:
    # only a padded leaf is gathered to be cut to its logical shape.
    split = {k for k, v in t.state_dict().items()
             if getattr(v, "is_fully_replicated", True) is False}
    assert split and all({s.data.size * 4 for s in v.addressable_shards} == {v.size}
                         for k, v in t.state_dict().items() if k in split)
    saved = {k: np.asarray(v) for k, v in t.state_dict().items()}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(7, t.state_dict(), None, {})
    ckpt.manager.wait_until_finished()

    fresh = mlp_trainer(4, optax.adam(1e-3), sharding="full")
    template = fresh.state_template()
    assert {k for k, v in template.items() if isinstance(v, jax.ShapeDtypeStruct)} == split
    assert all(isinstance(v, np.ndarray) for k, v in template.items() if k not in split)
    held = sum(s.data.nbytes for x in fresh._leaves for s in x.addressable_shards)

    def refuse(meta):
        raise dpax.DpaxError("refused")

    with pytest.raises(dpax.DpaxError, match="refused"):
        fresh.restore(ckpt, check=refuse)
    assert all(np.isfinite(v).all() for v in fresh.state_dict().values())  # still its own
    split_bytes = sum(saved[k].nbytes for k in split)
    seen, read = [], ckpt.manager.restore

    def counting(step, args):
        if "state" not in args:  # the meta
            return read(step, args=args)
        seen.append(device_bytes())
        out = read(step, args=args)
        seen.append(device_bytes())
        return out

    monkeypatch.setattr(ckpt.manager, "restore", counting)
    before = device_bytes()
    step, _ = fresh.restore(ckpt)
    ckpt.close()
    assert step == 7
    assert before - seen[0] > 0.95 * held  # the current state went first
    assert seen[1] - seen[0] == split_bytes  # the read: split leaves, one copy over 4 devices
    assert device_bytes() - before < 0.05 * held  # taken as read, not copied
    assert all(np.array_equal(v, saved[k]) for k, v in fresh.state_dict().items())
    kernel = fresh._field("params")["layers"][0]["kernel"].get_value()
    assert {s.data.size * 4 for s in kernel.addressable_shards} == {kernel.size}  # 1/4 each

    other = mlp_trainer(4, optax.adam(1e-3), sharding="full")
    other.load_state_dict(fresh.state_dict())
    ds = digits()
    other.fit(ds.x_train[:8], ds.y_train[:8], batch_size=8, until_step=1)
    assert all(np.array_equal(v, saved[k]) for k, v in fresh.state_dict().items())


def test_the_optimizer_state_and_ema_start_on_the_host_not_the_models_device(monkeypatch):
    """`tx.init` and the EMA run on the host's CPU device: on the model's device
    they would be made whole there (Adam's moments: twice the params) before a
    layout splits them. Here device 7 stands in for the host."""
    import jax
    from flax import nnx

    from dpax.training import state as states

    monkeypatch.setattr(states, "host_device", lambda: jax.devices()[7])
    with jax.default_device(jax.devices()[0]):
        model = dpax.models.MLP((16,), 10, hidden=(32,), rngs=nnx.Rngs(0))
    _, state = states.init_state(model, optax.adam(1e-3), ema=True)
    made = jax.tree.leaves((state.opt_state, state.ema, state.step, state.rng))
    assert {d for x in made for d in x.devices()} == {jax.devices()[7]}
    assert {d for x in jax.tree.leaves(state.params) for d in x.devices()} == {jax.devices()[0]}


def test_the_initial_state_is_one_program_where_that_is_exact_and_as_written_otherwise(
        monkeypatch):
    """`init_state` makes the optimizer state, counters and EMA in one program
    (op by op, each zeros of a new shape is a program to compile before the
    first step), kept for the next Trainer of the same shapes, and its state
    is the op-by-op one bit for bit, dtypes, weak types and classes included:
    an init that computes (DoG's norm, a mean, a comparison, a branch, a
    conversion of a constant), keeps a constant other than zero (a learning
    rate), a Python number, or reads a value in Python runs as written."""
    from typing import NamedTuple

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dpax.parallel.arrays import is_key
    from dpax.training import one_program
    from dpax.training import state as states

    whole, built = [], []
    compile_, build = one_program._compile, one_program._build
    monkeypatch.setattr(one_program, "_compiled", collections.OrderedDict())
    monkeypatch.setattr(one_program, "_compile", lambda t, a: whole.append(1) or compile_(t, a))
    monkeypatch.setattr(one_program, "_build", lambda lowered: built.append(1) or build(lowered))

    # Shapes no other test makes. At this init DoG's norm of the params rounds
    # otherwise under jit on some CPUs; the other cases fail anywhere.
    model = dpax.models.MLP((19,), 7, hidden=(23, 29), rngs=nnx.Rngs(2))
    states.init_state(model, optax.adam(1e-3), seed=3, ema=True)
    assert built == [1]
    states.init_state(model, optax.adam(1e-3), seed=4, ema=True)  # the next Trainer's
    assert built == [1]
    # A program that reads no param (plain SGD's) is the same text for any
    # shapes; its executable checks them, so it is kept per shape.
    for net in (model, dpax.models.MLP((19,), 7, hidden=(11,), rngs=nnx.Rngs(0)), model):
        states.init_state(net, optax.sgd(0.1))
    assert built == [1, 1, 1]

    def plain(init):
        return optax.GradientTransformation(init, lambda g, s, p=None: (g, s))

    def reads_a_value(params):  # jit cannot trace float() of a param
        scale = float(jnp.max(jnp.abs(jax.tree.leaves(params)[0])))
        return jax.tree.map(lambda p: jnp.full_like(p, scale), params)

    def named():  # a state class named State, new at each call: each keeps its own
        class State(NamedTuple):
            zeros: Any

        return plain(lambda p: State(jax.tree.map(jnp.zeros_like, p)))
    half = dpax.models.MLP((19,), 7, hidden=(23, 29), rngs=nnx.Rngs(2))
    nnx.update(half, jax.tree.map(lambda p: p.astype(jnp.bfloat16), nnx.state(half, nnx.Param)))
    one, written = True, False
    cases = [
        ("adam", model, optax.adam(1e-3), one),
        ("momentum", model, optax.sgd(0.1, momentum=0.9), one),
        ("bf16 params", half, optax.adam(1e-3), one),
        ("nested zeros", model, plain(lambda p: jax.tree.map(jax.jit(jnp.zeros_like), p)), one),
        ("complex zeros", model, plain(lambda p: {"c": jnp.zeros((3,), jnp.complex64)}), one),
        ("a type with no zero", model, plain(lambda p: {"c": jnp.zeros((3,)).astype(
            jnp.float8_e8m0fnu)}), written),
        ("a State", model, named(), one),
        ("another State", model, named(), one),
        ("dog", model, optax.contrib.dog(), written),
        ("lr 0.1", model, optax.inject_hyperparams(optax.adam)(learning_rate=0.1), written),
        ("lr array", model, optax.inject_hyperparams(optax.adam)(
            learning_rate=jnp.float32(0.1)), written),
        ("bool of a denormal", model, plain(lambda p: jax.tree.map(
            lambda a: jnp.full_like(a, 1e-40).astype(bool), p)), written),
        ("a NaN's payload", model, plain(lambda p: {"c": jax.lax.bitcast_convert_type(
            jnp.uint32(0x7FC12345), jnp.float32).astype(jnp.bfloat16)}), written),
        ("mean", model, plain(lambda p: jax.tree.map(lambda a: 0.1 * jnp.mean(jnp.abs(a)), p)),
         written),
        ("nested arithmetic", model, plain(lambda p: jax.tree.map(jax.jit(lambda a: a * 2), p)),
         written),
        ("float compare", half, plain(lambda p: jax.tree.map(lambda a: a == 0, p)), written),
        ("branch", model, plain(lambda p: {"n": jax.lax.cond(
            True, lambda: jnp.int32(1), lambda: jnp.int32(2))}), written),
        ("int to bf16", model, plain(lambda p: {"c": jnp.full((3,), 16842753).astype(
            jnp.bfloat16)}), written),
        ("python numbers", model, plain(lambda params: {"lr": 0.1, "count": 3}), written),
        ("reads a value", model, plain(reads_a_value), written),
    ]

    def bits(a):
        a = jax.random.key_data(a) if is_key(a) else a
        return np.asarray(a).tobytes(), np.shape(a), np.asarray(a).dtype, getattr(
            a, "weak_type", None)

    for name, net, tx, at_once in cases:
        whole.clear()
        _, params, _ = nnx.split(net, nnx.Param, ...)
        _, state = states.init_state(net, tx, seed=3, ema=True)
        assert bool(whole) == at_once, name
        zero = jnp.zeros((), jnp.int32)
        want = (tx.init(params), jax.random.key_data(jax.random.key(3)), zero, zero)
        got = (state.opt_state, state.rng, state.step, state.bad_in_a_row)
        assert jax.tree.structure(got) == jax.tree.structure(want), name
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert bits(a) == bits(b), name
        for a, p in zip(jax.tree.leaves(state.ema), jax.tree.leaves(params)):
            assert a.dtype == jnp.float32
            assert np.array_equal(np.asarray(a), np.asarray(p, np.float32))


def test_train_step_takes_a_padded_masked_batch_and_names_the_fix_otherwise():
    """`train_step` and `lower_train_step` take a batch padded to
    `padded(size)` with a `mask` (what `pad_batch` makes): one such step is
    the step `fit` takes on that batch; an unpadded or unmasked one is refused
    with the fix, before JAX's own error from inside the step."""
    from dpax.data.batches import pad_batch

    ds = digits()
    x, y = ds.x_train[:13], ds.y_train[:13]
    ref = mlp_trainer(1, optax.sgd(0.1))
    ref.fit(x, y, batch_size=13, until_step=1)
    t = mlp_trainer(4, optax.sgd(0.1))
    for bad in ({"x": x, "y": y}, {"x": x, "y": y, "mask": np.ones(13, bool)}):
        for call in (t.train_step, t.lower_train_step):
            with pytest.raises(dpax.DpaxError, match=r"pad_batch\(batch, trainer.padded\(13\)\)"):
                call(bad)
    t.train_step(pad_batch({"x": x, "y": y}, t.padded(13)))
    assert max_diff(leaves(ref), leaves(t)) < 1e-6


@pytest.mark.parametrize("args,message", [
    ((None, dpax.classification_loss, "adam"),
     "`optimizer` must be an optax GradientTransformation .*got str 'adam'"),
    ((None, dpax.classification_loss, "nnx.Optimizer"),
     r"`optimizer` must be an optax .*got Optimizer.*: pass the optax transformation it "
     r"wraps, its `\.tx`"),
    ((lambda x: x, dpax.classification_loss, optax.adam(1e-2)),
     "`model` must be a Flax NNX module, got function: .*dpax.from_linen"),
    ((None, "ce", optax.adam(1e-2)), "`loss_fn` must be a function .*got str 'ce'"),
    ((None, lambda model: 0.0, optax.adam(1e-2)),
     r"`loss_fn` must take \(model, batch\), but <lambda>\(model\) cannot be called"),
])
def test_a_model_loss_or_optimizer_of_the_wrong_kind_is_named(args, message):
    """Each was an error from inside optax or Flax (AttributeError,
    IndexError) or, for a loss, a TypeError at the first step."""
    ds = digits()
    model = dpax.models.make_model("mlp", ds.input_shape, ds.n_out, 0)
    args = tuple(model if a is None else a for a in args)
    if args[2] == "nnx.Optimizer":
        args = args[:2] + (nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param),)
    with pytest.raises(dpax.DpaxError, match=message):
        dpax.Trainer(*args, devices=1)


def test_a_loss_of_one_argument_is_bad_input_through_the_cli(tmp_path, monkeypatch, capsys):
    """`dpax check --loss` with a loss that takes the model only: exit 2 and
    one line (it was a TypeError at the first step, exit 1)."""
    assert check_loss_cli(tmp_path, monkeypatch, "onearg:loss",
                          "def loss(model):\n    return 0.0\n") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--loss must take (model, batch)" in err, err


def test_idle_devices_are_warned_of_once_per_trainer_and_batch():
    """`dpax check` fits one step at a time: its one warning came once per
    step. One device of two idle reads 'sees'."""
    import warnings

    ds = digits()
    t = mlp_trainer(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for until in (1, 2, 3):
            t.fit(ds.x_train, ds.y_train, batch_size=1, until_step=until)
    idle = [str(w.message) for w in caught if "only padding" in str(w.message)]
    assert idle == ["batches of 1 examples on 2 devices: 1 of them sees only padding every "
                    "step; use a `batch_size` that is a multiple of 2"]


def test_the_trained_model_runs_in_train_mode():
    """`trainer.model()` held the host's read-only copies: a BatchNorm in
    train mode failed to write its running mean (a reviewer's)."""
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(6, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.dense(x))

    x = np.random.default_rng(0).normal(size=(30, 6)).astype(np.float32)
    t = dpax.Trainer(Net(nnx.Rngs(0)), lambda m, b: (m(b["x"]) ** 2).sum(1),
                     optax.adam(0.01), devices=2)
    t.fit({"x": x}, batch_size=10, until_step=2, log_every=10**9)
    model = t.model()
    before = np.array(model.norm.mean[...])
    model.train()
    model(x[:4])
    assert max_diff(before, model.norm.mean[...]) > 0
