"""Backends (`dpax.parallel.backends`): where each puts the state and a batch's rows,
and the rules they keep in one place."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from dpax.cli.train import TrainConfig
from dpax.errors import DpaxError
from dpax.parallel import backends, platform
from dpax.parallel.backends import DEFAULT_BACKEND, check_backend


@pytest.fixture(scope="module")
def devices():
    return dpax.select_devices(4)


def make_backend(name, devices):
    return backends.make_backend(name, devices, platform.for_devices(devices))


def test_shard_map_hands_host_rows_to_the_step_and_pmap_adds_a_device_axis(devices):
    batch = {"x": np.arange(24.0).reshape(8, 3), "y": np.arange(8), "mask": np.ones(8, bool)}
    shard_map = make_backend(DEFAULT_BACKEND, devices)
    assert shard_map.step_input(batch, 8) is batch  # one process: jit splits the rows
    assert shard_map.local_rows(8) == (0, 8)
    stacked = make_backend("pmap", devices).step_input(batch, 8)
    assert stacked["x"].shape == (4, 2, 3)
    np.testing.assert_array_equal(stacked["x"].reshape(8, 3), batch["x"])


def test_k_batches_stack_along_a_leading_step_axis(devices):
    batches = [{"x": np.full((8, 2), float(i))} for i in range(3)]
    assert make_backend("shard_map", devices).put_batches(batches, 8)["x"].shape == (3, 8, 2)
    assert make_backend("pmap", devices).put_batches(batches, 8)["x"].shape == (4, 3, 2, 2)


def test_both_backends_implement_the_whole_backend_protocol(devices):
    """Training asks a backend only what `Backend` declares, and each backend
    defines every part itself; pmap refuses a split state's step by name."""
    methods = [k for k in vars(backends.Backend) if not k.startswith("_")]
    assert {"put_state", "per_device", "global_stepper", "host"} <= set(methods)
    for name in backends.BACKENDS:
        backend = make_backend(name, devices)
        for method in methods:
            assert method in vars(type(backend)), (name, method)
        for attribute in backends.Backend.__annotations__:
            assert hasattr(backend, attribute), (name, attribute)
    pmap = make_backend("pmap", devices)
    with pytest.raises(DpaxError, match="needs `backend=shard_map`"):
        pmap.per_device(lambda x: x, None, None)


def test_replicated_state_reads_back_as_one_logical_copy(devices):
    state = {"w": np.arange(6.0).reshape(2, 3)}
    for name in ("shard_map", "pmap"):
        backend = make_backend(name, devices)
        placed = backend.put_state(state)
        np.testing.assert_array_equal(backend.host(placed)["w"], state["w"])
        assert dpax.pmap.replicas_in_sync(placed)


@pytest.mark.parametrize("name,processes,needle", [
    ("tpu", 1, "unknown backend 'tpu'"), ("pmap", 2, "single-process only")])
def test_backend_rules_live_in_one_place(name, processes, needle):
    with pytest.raises(DpaxError, match=needle):
        check_backend(name, processes)
    with pytest.raises(DpaxError, match=needle):
        dpax.config.validate(TrainConfig.from_flags(
            backend=name, num_processes=processes, coordinator="h:1", process_id=0))


class LSTMNet(nnx.Module):
    """nnx.RNN starts its carry from zeros, the same on every device."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(20, 8, rngs=rngs)
        self.rnn = nnx.RNN(nnx.LSTMCell(8, 8, rngs=rngs))
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.rnn(self.emb(x))[:, -1])


def test_a_recurrent_model_names_the_backend_that_trains_it():
    """shard_map's type check refuses nnx.RNN's carry in one line that names
    pmap; pmap then trains what one device trains."""
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 20, (21, 5)).astype(np.int32), rng.integers(0, 3, 21)

    def train(n, backend):
        t = dpax.Trainer(LSTMNet(nnx.Rngs(0)), dpax.classification_loss, optax.adam(1e-2),
                         devices=n, backend=backend)
        t.fit(ids, y, batch_size=7, until_step=3, log_every=10**9)
        return t.params

    with pytest.raises(DpaxError, match=r"pass `backend=pmap`") as e:
        train(2, "shard_map")
    assert "\n" not in str(e.value)
    for a, b in zip(jax.tree.leaves(train(1, "shard_map")), jax.tree.leaves(train(2, "pmap"))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
