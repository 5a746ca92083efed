"""Optimizers, schedules and datasets behind the CLI names; the input pipeline."""

import numpy as np
import pytest

import dpax
from dpax import data, optim
from dpax.pipeline import TrainedPosition, local_part, train_batches


def test_schedule_lives_in_the_optimizer_state_and_never_recompiles():
    ds = data.digits()
    schedule = optim.make_schedule(0.1, "warmup-cosine", warmup_steps=4, total_steps=12)
    t = dpax.Trainer(dpax.make_model("mlp", ds.input_shape, ds.n_out, 0),
                     dpax.classification_loss, optim.make_optimizer("momentum", schedule),
                     devices=4, schedule=schedule)
    rows = t.fit(ds.x_train, ds.y_train, batch_size=30, steps=12, log_every=1)
    lrs = [r["lr"] for r in rows]
    np.testing.assert_allclose(lrs, [float(schedule(s)) for s in range(12)], rtol=1e-6)
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(0.1) and lrs[-1] < lrs[4]
    assert t.traces["train"] == 1


def test_constant_schedule_with_warmup_ramps_then_holds():
    s = optim.make_schedule(0.2, "constant", warmup_steps=4)
    assert [round(float(s(i)), 6) for i in (0, 2, 4, 100)] == [0.0, 0.1, 0.2, 0.2]


def test_scale_lr_is_the_linear_rule():
    assert optim.scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    cfg = dpax.TrainConfig(model="mlp", devices=2, optimizer="sgd", lr=0.01, scale_lr=True,
                           reference_batch=32, batch_size=64, steps=2, log_every=1)
    result = dpax.train(cfg, log=None)
    assert result.history[-1]["lr"] == pytest.approx(0.02)


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_every_named_optimizer_trains(name):
    lr = {"sgd": 0.5, "momentum": 0.1, "adam": 3e-3, "adamw": 3e-3}[name]
    cfg = dpax.TrainConfig(model="mlp", devices=2, optimizer=name, lr=lr, batch_size=64,
                           steps=30, log_every=5)
    result = dpax.train(cfg, log=None)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert last < 0.6 * first, (first, last)


def test_digits_split_is_fixed_and_covers_every_image():
    a, b = data.digits(), data.digits()
    assert len(a.x_train) + len(a.x_eval) == 1797
    np.testing.assert_array_equal(a.y_eval, b.y_eval)
    assert a.x_train.shape[1:] == (8, 8, 1) and a.x_train.dtype == np.float32
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0


def test_random_images_are_nhwc_and_learnable_labels():
    ds = data.random_images(n=64)
    assert ds.x_train.shape[1:] == (32, 32, 3) and ds.n_out == 10


def test_user_npz_classification_and_regression(tmp_path):
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float64)
    np.savez(tmp_path / "c.npz", x=x, y=np.arange(50) % 3)
    np.savez(tmp_path / "r.npz", x=x, y=x.sum(1))
    c, r = data.load(str(tmp_path / "c.npz")), data.load(str(tmp_path / "r.npz"))
    assert c.task == "classification" and c.n_out == 3 and c.x_train.dtype == np.float32
    assert r.task == "regression" and len(r.x_train) + len(r.x_eval) == 50
    cfg = dpax.TrainConfig(model="mlp", data=str(tmp_path / "r.npz"), devices=4,
                           optimizer="sgd", lr=0.05, batch_size=7, steps=3, log_every=3)
    assert np.isfinite(dpax.train(cfg, log=None).eval["loss"])


# -- the input pipeline ------------------------------------------------------------------
@pytest.mark.parametrize("batch_size,rows", [(61, (0, 64)), (61, (16, 32)), (64, (0, 64))])
def test_chunked_batches_equal_per_step_batches_and_resume_mid_chunk(batch_size, rows):
    """Small batches are built several steps at a time; each step's batch is
    still `local_part` of that step's examples (61: epochs end padded), and a
    position saved inside a chunk resumes at exactly the next step."""
    x = np.random.default_rng(0).random((300, 5), np.float32)
    y = np.arange(300)
    plan = dpax.BatchPlan(300, batch_size, seed=3)
    want = [local_part(x, y, plan.indices(s), rows) for s in range(7, 50)]

    def same(got, expected):
        assert len(got) == len(expected)
        for g, w in zip(got, expected):
            assert g.keys() == w.keys()
            for k in w:
                np.testing.assert_array_equal(g[k], w[k])

    same(list(train_batches(x, y, plan, rows, 7, 50)), want)
    read = TrainedPosition(iter(train_batches(x, y, plan, rows, 7, 50)))
    for _ in range(13):  # read ahead of training, as the Trainer does
        next(read)
    read.trained(11)
    resumed = TrainedPosition(iter(train_batches(x, y, plan, rows, 7, 50)))
    resumed.set_state(read.get_state())
    same(list(resumed), want[11:])


def test_a_position_in_another_format_is_left_for_the_caller_to_rebuild():
    """An older dpax saved Grain's per-step state; restoring it must not move the
    iterator (run.py then rebuilds the position from the checkpoint's step)."""
    x, y = np.zeros((40, 2), np.float32), np.arange(40)
    plan = dpax.BatchPlan(40, 8, seed=0)
    it = TrainedPosition(iter(train_batches(x, y, plan, (0, 8), 0, 10)))
    it.set_state(b'{"next_index": 3}')
    assert not it.restored
    np.testing.assert_array_equal(next(it)["y"], y[plan.indices(0)])
    it.set_state(it.get_state())
    assert it.restored
