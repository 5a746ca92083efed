"""A run's periodic duties (`dpax.training.hooks`): each fires when a call crosses a
multiple of its cadence, whatever the log cadence or the steps per call."""

import signal

import pytest

import dpax
from conftest import digits, mlp_trainer
from dpax.training import hooks
from dpax.training.loop import Every


def crossings(boundaries, every, total):
    """The call boundaries at which a multiple of `every` was crossed, before `total`."""
    due, out = Every(every), []
    for b in boundaries:
        if due(b) and b < total:
            out.append(b)
    return out


@pytest.mark.parametrize("eval_every,log_every,steps_per_call,total", [
    (25, 10, 1, 100),   # cadences that are not multiples of each other
    (10, 4, 8, 80),     # several steps per call: the state exists at call boundaries only
    (7, 100, 1, 30),    # evaluations between the logs
])
def test_evaluations_fire_at_every_crossing(eval_every, log_every, steps_per_call, total):
    ds = digits()
    t = mlp_trainer(2, steps_per_call=steps_per_call)
    data = {"x": ds.x_eval, "y": ds.y_eval}
    rows = t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=total, log_every=log_every,
                 hooks=[hooks.Evaluate(t, data, eval_every, total)])
    evaluated = [r["step"] for r in rows if "eval_loss" in r]
    boundaries = range(steps_per_call, total + 1, steps_per_call)
    assert evaluated == crossings(boundaries, eval_every, total)
    assert evaluated  # the test has something to check
    logs = crossings(boundaries, log_every, total + 1)
    assert sorted({r["step"] for r in rows}) == sorted(set(logs + evaluated + [total]))
    ev = t.evaluate(data)  # the last row's evaluation is of the state at its step
    assert rows[-1]["step"] == total and "eval_loss" not in rows[-1]
    assert ev["loss"] > 0


def test_checkpoints_fire_at_every_crossing(tmp_path):
    """The same trigger saves checkpoints: every 5 steps with 3 steps per call."""
    ds = digits()
    t = mlp_trainer(2, steps_per_call=3)
    saved = []

    class Recorder:  # stands in for the Checkpointer and the state it would save
        def save(self, step, *args):
            saved.append(step)

        def state_dict(self):
            return {}

    hook = hooks.Checkpoint(Recorder(), Recorder(), None, {}, every=5)
    t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=21, hooks=[hook])
    assert saved == crossings(range(3, 22, 3), 5, 22) == [6, 12, 15, 21]


def test_a_hook_that_wants_a_row_gets_one():
    ds = digits()
    t = mlp_trainer(1)

    class At(dpax.training.loop.Hook):
        def wants_row(self, step):
            return step == 7

    rows = t.fit(ds.x_train, ds.y_train, batch_size=32, until_step=12, log_every=5,
                 hooks=[At()])
    assert [r["step"] for r in rows] == [5, 7, 10, 12]


def test_a_stop_whose_state_is_not_finite_does_not_say_it_saved(tmp_path):
    """The save at a signal returns False for a state that is not finite:
    the stop says no checkpoint was saved, and names where `resume` reads."""

    class NotFinite:  # a Checkpointer that refuses the state, as for a NaN
        directory = str(tmp_path)

        def save(self, step, *args):
            return False

        def state_dict(self):
            return {}

        def close(self):
            pass

    stop = hooks.StopOnSignal(hooks.Checkpoint(NotFinite(), NotFinite(), None, {}, every=0))
    stop.signum = signal.SIGTERM
    with pytest.raises(dpax.errors.Preempted) as stopped:
        stop.after_step(7)
    assert str(stopped.value) == (
        "stopped by SIGTERM at step 7; its state is not finite, so it was not checkpointed: "
        f"`resume` continues the newest checkpoint in {tmp_path}")
