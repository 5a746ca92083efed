"""The training loop (`dpax.training.loop`): steps per call, metric sums, log cadence,
hooks, the GC, and the in-flight bound kept to XLA:CPU."""

import gc

import numpy as np
import pytest

import dpax
from conftest import STEPS, digits, fit_digits, leaves, max_diff, mlp_trainer
from dpax.parallel import platform
from dpax.training import loop


class AfterStep(loop.Hook):
    def __init__(self, fn):
        self.fn = fn

    def after_step(self, step):
        self.fn(step)


# -- steps per call ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_eight_steps_per_call_equal_one_per_call(backend):
    one = mlp_trainer(4, backend=backend)
    eight = mlp_trainer(4, backend=backend, steps_per_call=8)
    rows1 = fit_digits(one, 61, steps=20, log_every=4)
    rows8 = fit_digits(eight, 61, steps=20, log_every=4)
    assert max_diff(leaves(eight), leaves(one)) <= 1e-6
    assert eight.traces["train_multi"] == 1  # steps 1-16 in two calls, 17-20 one by one
    # Logs land on call boundaries; their means cover exactly the steps since the last.
    assert [r["step"] for r in rows8] == [8, 16, 20]
    assert sum(r["examples"] for r in rows8) == sum(r["examples"] for r in rows1) == 20 * 61


# -- metric sums -------------------------------------------------------------------------
def test_a_log_over_several_device_sums_equals_the_per_step_logs(monkeypatch):
    """The step adds its metrics into sums on the device; the host takes them
    over every STEPS_PER_SUM steps (here 3) and combines them at the log."""
    monkeypatch.setattr(dpax.training.loop, "STEPS_PER_SUM", 3)
    per_step = fit_digits(mlp_trainer(4, skip_nonfinite=True), 61, log_every=1)
    (row,) = fit_digits(mlp_trainer(4, skip_nonfinite=True), 61, log_every=STEPS)
    examples = np.array([r["examples"] for r in per_step])
    assert row["examples"] == examples.sum() == STEPS * 61
    for key in ("loss", "accuracy"):
        mean = np.dot([r[key] for r in per_step], examples) / examples.sum()
        assert abs(row[key] - mean) <= 1e-6 * abs(mean), key
    assert row["grad_norm"] == per_step[-1]["grad_norm"]  # not a sum: the last step's
    assert row["skipped"] == 0


# -- the training loop and Python's GC ---------------------------------------------------
def test_fit_runs_no_full_collection_and_restores_the_gc(monkeypatch):
    """While the loop runs, the step's first trace included, Python's collector
    collects young generations only (a full one pauses a fast loop, and walks
    every object the trace made); afterwards its thresholds are the caller's,
    and a freeze the caller made stays."""
    t = mlp_trainer(1)
    ds = digits()
    before = gc.get_threshold()
    collected, running = [], [False]
    zero_sums = t._steps.zero_sums

    def traced(*args):  # the step's first trace
        running[0] = True
        return zero_sums(*args)

    monkeypatch.setattr(t._steps, "zero_sums", traced)

    def record(phase, info):
        if phase == "start" and running[0]:
            collected.append(info["generation"])

    class Running(loop.Hook):  # marks the loop's span, making young objects each step
        def on_start(self, step):
            running[0] = True

        def after_step(self, step):
            [[] for _ in range(50)]
            running[0] = step < 4

    gc.set_threshold(5, 1, 1)  # a full collection every few allocations, unless prevented
    gc.callbacks.append(record)
    gc.freeze()
    try:
        t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=4,
              hooks=[Running()])
        assert gc.get_threshold() == (5, 1, 1)
        assert gc.get_freeze_count() > 0  # the caller's freeze stays: not unfrozen
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*before)
        gc.unfreeze()
    assert collected and 2 not in collected, collected  # young collections only


# -- hooks and triggers ------------------------------------------------------------------
def test_every_fires_once_per_multiple_crossed():
    every = loop.Every(5, start=3)
    assert [s for s in (4, 5, 6, 13, 14, 15, 16) if every(s)] == [5, 13, 15]
    never = loop.Every(0)
    assert not any(never(s) for s in range(1, 20))


class Record(loop.Hook):
    def __init__(self):
        self.events = []

    def on_start(self, step):
        self.events.append(("start", step))

    def on_log(self, step, row):
        self.events.append(("log", step))

    def after_step(self, step):
        self.events.append(("step", step))


def test_hooks_see_the_start_each_log_then_each_step():
    t, record = mlp_trainer(2), Record()
    ds = digits()
    t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=3, log_every=2, hooks=[record])
    assert record.events == [("start", 0), ("step", 1), ("log", 2), ("step", 2),
                             ("log", 3), ("step", 3)]


def test_the_in_flight_bound_is_for_xla_cpu_with_several_devices():
    assert mlp_trainer(4)._loop_steps().in_flight == platform.MAX_IN_FLIGHT
    assert mlp_trainer(1)._loop_steps().in_flight is None  # no rendezvous to overrun


def test_evaluate_and_predict_bound_their_queue_too(monkeypatch):
    """An eval set of many batches on 8 simulated devices once queued every
    call and XLA:CPU aborted ("Termination timeout for all reduce", found
    evaluating 280,000 examples in memory): all but the newest
    `MAX_IN_FLIGHT` calls are waited for."""
    t, ds = mlp_trainer(8, predict_fn=dpax.classification_predict), digits()
    waits = []
    real = loop.jax.block_until_ready
    monkeypatch.setattr(loop.jax, "block_until_ready", lambda x: waits.append(1) or real(x))
    calls = -(-len(ds.x_eval) // 16)
    ev = t.evaluate(ds.x_eval, ds.y_eval, batch_size=16)
    assert len(waits) == calls - platform.MAX_IN_FLIGHT and ev["examples"] == len(ds.x_eval)
    waits.clear()
    assert len(t.predict(ds.x_eval, batch_size=16)) == len(ds.x_eval)
    assert len(waits) == calls - platform.MAX_IN_FLIGHT
