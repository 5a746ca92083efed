"""Optimizers and schedules behind the CLI names (`dpax.training.optim`)."""

import numpy as np
import pytest

import dpax
from dpax import data
from dpax.cli.train import TrainConfig, train
from dpax.training import optim


def test_schedule_lives_in_the_optimizer_state_and_never_recompiles():
    ds = data.digits()
    schedule = optim.make_schedule(0.1, "warmup-cosine", warmup_steps=4, total_steps=12)
    t = dpax.Trainer(dpax.make_model("mlp", ds.input_shape, ds.n_out, 0),
                     dpax.classification_loss, optim.make_optimizer("momentum", schedule),
                     devices=4, schedule=schedule)
    rows = t.fit(ds.x_train, ds.y_train, batch_size=30, until_step=12, log_every=1)
    lrs = [r["lr"] for r in rows]
    np.testing.assert_allclose(lrs, [float(schedule(s)) for s in range(12)], rtol=1e-6)
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(0.1) and lrs[-1] < lrs[4]
    assert t.traces["train"] == 1


def test_constant_schedule_with_warmup_ramps_then_holds():
    s = optim.make_schedule(0.2, "constant", warmup_steps=4)
    assert [round(float(s(i)), 6) for i in (0, 2, 4, 100)] == [0.0, 0.1, 0.2, 0.2]


def test_scale_lr_is_the_linear_rule():
    assert optim.scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    cfg = TrainConfig.from_flags(
        model="mlp", devices=2, optimizer="sgd", lr=0.01, scale_lr=True,
                           reference_batch=32, batch_size=64, steps=2, log_every=1)
    result = train(cfg, log=None)
    assert result.history[-1]["lr"] == pytest.approx(0.02)


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_every_named_optimizer_trains(name):
    lr = {"sgd": 0.5, "momentum": 0.1, "adam": 3e-3, "adamw": 3e-3}[name]
    cfg = TrainConfig.from_flags(
        model="mlp", devices=2, optimizer=name, lr=lr, batch_size=64,
                           steps=30, log_every=5)
    result = train(cfg, log=None)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert last < 0.6 * first, (first, last)
