"""Examples kept on the devices (`dpax.data.resident`): the batches gathered there
are the host pipeline's, so training gives the numbers it gives."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import digits, max_diff, mlp_trainer
from dpax.cli import main
from dpax.data import resident
from dpax.data.augment import parse
from dpax.data.batches import ROWS, gather_rows
from dpax.data.pipeline import BatchPlan, local_parts
from dpax.data.sources import ArrayTable, Column
from dpax.errors import DpaxError
from dpax.training import compiled

TOL = 1e-5  # as tests/test_equivalence.py: N devices against one


def test_gathered_batches_are_the_host_pipelines():
    """Row for row, padded rows the same copies, nested keys and every dtype kept: a
    short last batch of an epoch (10 examples, batches of 4) included."""
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(10, 3, 2)).astype(np.float32),
            "y": np.arange(10, dtype=np.int32) + 7,
            "extra": {"tokens": rng.integers(1, 9, size=(10, 5)).astype(np.uint8)}}
    plan = BatchPlan(10, 4, seed=3)
    index = {ROWS: np.arange(10, dtype=np.int32)}
    steps = range(0, 7)  # epochs of 3 steps: two short batches
    on_device = jax.device_put(data)
    # (2, 4): a second process's part, which holds no example of the short batches.
    for part in ((0, 4), (2, 4)):
        for host, rows in zip(local_parts(data, plan, part, steps),
                              local_parts(index, plan, part, steps)):
            got = gather_rows(on_device, rows)
            assert jax.tree.structure(got) == jax.tree.structure(host)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(host)):
                assert a.dtype == b.dtype and np.array_equal(np.asarray(a), b)


CASES = {  # id: (devices, Trainer options)
    "1": (1, {}),
    "4 devices, 3 steps per call": (4, {"steps_per_call": 3}),
    "pmap 2, 2 steps per call": (2, {"backend": "pmap", "steps_per_call": 2}),
    "full 4, grad_accum 2": (4, {"sharding": "full", "grad_accum": 2}),
}


def _fit_twice(t, seed, **kw):
    """Two calls (the second starts mid-epoch): the rows of both."""
    ds = digits()
    x, y = ds.x_train[:300], ds.y_train[:300]
    return [t.fit(x, y, batch_size=37, until_step=until, seed=seed, log_every=1, **kw)
            for until in (5, 12)]


@pytest.fixture(scope="module", params=[0, 1], ids=lambda s: f"seed {s}")
def host_one_device(request):
    t = mlp_trainer(1)
    rows = _fit_twice(t, request.param, data_on_device=False)
    return request.param, jax.tree.leaves(t.params), rows


@pytest.mark.equivalence  # again with the opt-in XLA:CPU tuning (make test-tuned)
@pytest.mark.parametrize("case", CASES)
def test_training_on_gathered_batches_is_training_on_host_batches(case, host_one_device):
    seed, params, rows = host_one_device
    n, options = CASES[case]
    t = mlp_trainer(n, **options)
    got = _fit_twice(t, seed, data_on_device=True)
    assert dict(t.traces).get("train", 0) + dict(t.traces).get("train_multi", 0) <= 2
    assert max_diff(jax.tree.leaves(t.params), params) <= TOL
    for call, want in zip(got, rows):  # every example counted once, the same losses
        assert sum(r["examples"] for r in call) == sum(r["examples"] for r in want)
        if "steps_per_call" not in options:  # else a row per call, not per step
            assert [r["step"] for r in call] == [r["step"] for r in want]
            assert max(abs(a["loss"] - b["loss"]) for a, b in zip(call, want)) <= TOL


class _Device:
    def __init__(self, memory, in_use=0):
        self.memory, self.in_use = memory, in_use

    def memory_stats(self):
        return None if self.memory is None else {"bytes_limit": self.memory,
                                                 "bytes_in_use": self.in_use}


def test_the_default_keeps_examples_on_accelerators_with_free_memory_to_spare():
    data = {"x": np.zeros((1000, 100), np.float32), "y": np.zeros(1000, np.int32)}  # 404 kB
    ctx = dict(batches_given=False, augment=False, workers=0)
    assert resident.choose(None, data, [_Device(8 << 20)] * 2, "gpu", **ctx)
    assert not resident.choose(None, data, [_Device(8 << 20), _Device(1 << 20)], "gpu", **ctx)
    # the free memory counts: a model that fills the device leaves no room
    assert not resident.choose(None, data, [_Device(8 << 20, in_use=7 << 20)], "gpu", **ctx)
    assert not resident.choose(None, data, [_Device(None)], "tpu", **ctx)  # memory unknown
    assert not resident.choose(None, data, [_Device(8 << 20)], "gpu", 2, **ctx)  # 2 processes
    assert resident.choose(True, data, [_Device(8 << 20)], "gpu", 2, **ctx)
    assert not resident.choose(None, data, [_Device(8 << 30)], "cpu", **ctx)  # host memory
    assert not resident.choose(False, data, [_Device(8 << 30)], "gpu", **ctx)
    assert resident.choose(True, data, [_Device(None)], "cpu", **ctx)
    assert not resident.choose(None, data, [_Device(8 << 30)], "gpu",
                               **dict(ctx, augment=True))


@pytest.mark.parametrize("why", ["batches", "augment", "data_workers", "columns"])
def test_examples_on_the_devices_where_they_cannot_be_is_an_error(why):
    ds = digits()
    t = mlp_trainer(1)
    x, kw = ds.x_train, {}
    if why == "batches":
        kw["batches"] = iter([])
    elif why == "augment":
        kw["augment"] = parse("flip")
    elif why == "data_workers":
        kw["data_workers"] = 1
    else:
        x = Column(ArrayTable(ds.x_train, "digits"))
    with pytest.raises(DpaxError, match=why):
        t.fit(x, ds.y_train, batch_size=32, until_step=1, data_on_device=True, **kw)
    assert t.step == 0


@pytest.mark.slow  # three `dpax train` runs (in this process)
def test_the_cli_resumes_across_batches_on_the_host_and_on_the_devices(tmp_path, monkeypatch):
    """`dpax train --data-on-device` saves and resumes the data position as the
    host pipeline does: host -> devices -> host, on 4, 2 and 8 devices, equals
    the uninterrupted run."""
    gathered = []
    real = compiled.gather_rows
    monkeypatch.setattr(compiled, "gather_rows", lambda *a: gathered.append(1) or real(*a))
    flags = ["train", "--model", "mlp", "--optimizer", "momentum", "--lr", "0.05",
             "--batch-size", "61", "--steps", "30", "--log-every", "5"]
    ref, a, b = (str(tmp_path / n) for n in ("ref", "a", "b"))
    assert main([*flags, "--devices", "4", "--checkpoint-dir", f"{ref}/ck",
                 "--checkpoint-every", "10", "--out", ref]) == 0
    assert not gathered  # CPU devices: host batches by default
    assert main([*flags, "--devices", "2", "--data-on-device", "--resume", f"{ref}/ck/10",
                 "--checkpoint-dir", f"{a}/ck", "--checkpoint-every", "10", "--out", a]) == 0
    assert gathered
    assert main([*flags, "--devices", "8", "--resume", f"{a}/ck/20", "--out", b]) == 0
    for out in (a, b):
        assert max_diff(_params(out), _params(ref)) <= TOL
        steps = [r["step"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
                 if "loss" in r]
        assert steps == list(range(15 if out == a else 25, 31, 5))  # each step once


def _params(out):
    with np.load(os.path.join(out, "params.npz")) as p:
        return {k: p[k] for k in p.files}
