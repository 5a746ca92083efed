"""The input pipeline (`dpax.data.pipeline`): batches by step, chunked on Grain,
resumable at the last batch trained on; the one count of a run's steps."""

import numpy as np
import pytest

from dpax.data.pipeline import BatchPlan, TrainedPosition, local_part, train_batches, train_input
from dpax.errors import DpaxError


@pytest.mark.parametrize("batch_size,rows", [(61, (0, 64)), (61, (16, 32)), (64, (0, 64))])
def test_chunked_batches_equal_per_step_batches_and_resume_mid_chunk(batch_size, rows):
    """Small batches are built several steps at a time; each step's batch is
    still `local_part` of that step's examples (61: epochs end padded), and a
    position saved inside a chunk resumes at exactly the next step."""
    x = np.random.default_rng(0).random((300, 5), np.float32)
    y = np.arange(300)
    plan = BatchPlan(300, batch_size, seed=3)
    want = [local_part({"x": x, "y": y}, plan.indices(s), rows) for s in range(7, 50)]

    def same(got, expected):
        assert len(got) == len(expected)
        for g, w in zip(got, expected):
            assert g.keys() == w.keys()
            for k in w:
                np.testing.assert_array_equal(g[k], w[k])

    same(list(train_batches({"x": x, "y": y}, plan, rows, 7, 50)), want)
    read = TrainedPosition(iter(train_batches({"x": x, "y": y}, plan, rows, 7, 50)))
    for _ in range(13):  # read ahead of training, as the Trainer does
        next(read)
    read.trained(11)
    resumed = TrainedPosition(iter(train_batches({"x": x, "y": y}, plan, rows, 7, 50)))
    resumed.set_state(read.get_state())
    same(list(resumed), want[11:])


def test_grains_checkpoint_handler_restores_the_trained_position(tmp_path):
    """Orbax saves the position through Grain's handler, which restores it with
    `set_state` and then `start_prefetch`."""
    import grain
    from etils import epath

    x, y = np.arange(80, dtype=np.float32).reshape(40, 2), np.arange(40)
    plan = BatchPlan(40, 8, seed=1)
    read = train_input({"x": x, "y": y}, plan, (0, 8), 0, 9)
    for _ in range(4):
        next(read)
    read.trained(3)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path), args=grain.checkpoint.CheckpointSave(read))
    resumed = handler.restore(epath.Path(tmp_path), args=grain.checkpoint.CheckpointRestore(
        train_input({"x": x, "y": y}, plan, (0, 8), 0, 9)))
    assert [b["y"].tolist() for b in resumed] == [y[plan.indices(s)].tolist()
                                                  for s in range(3, 9)]


def test_train_input_is_the_pipeline_fit_builds():
    x, y = np.arange(80, dtype=np.float32).reshape(40, 2), np.arange(40)
    plan = BatchPlan(40, 8, seed=1)
    got = list(train_input({"x": x, "y": y}, plan, (0, 8), 2, 7))
    assert [b["y"].tolist() for b in got] == [y[plan.indices(s)].tolist() for s in range(2, 7)]
    assert isinstance(train_input({"x": x, "y": y}, plan, (0, 8), 0, 1), TrainedPosition)


@pytest.mark.parametrize("steps,epochs,default,want", [
    (7, None, None, 7), (None, 2, None, 10), (None, None, 3, 15), (4, None, 3, 4)])
def test_total_steps_from_steps_or_epochs(steps, epochs, default, want):
    plan = BatchPlan(41, 10, seed=0)  # 5 steps an epoch: the last one padded
    assert plan.total_steps(steps, epochs, default) == want


@pytest.mark.parametrize("steps,epochs,needle", [
    (None, None, "exactly one"), (3, 2, "not both"), (0, None, "`steps` must be >= 1"),
    (None, 0, "`epochs` must be >= 1")])
def test_total_steps_refuses_what_has_no_length(steps, epochs, needle):
    with pytest.raises(DpaxError, match=needle):
        BatchPlan(41, 10, seed=0).total_steps(steps, epochs)
