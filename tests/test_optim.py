"""Optimizers and schedules behind the CLI names (`dpax.training.optim`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


@pytest.mark.parametrize("name,expected", [
    # Peak 1, 2 warmup steps, 12 steps in all, to 0.1; wsd decays over the last 3.
    ("constant", [0, .5] + [1] * 10),
    ("warmup-linear", [0, .5] + [1 - .09 * i for i in range(10)]),
    ("warmup-cosine", [0, .5] + [.1 + .45 * (1 + np.cos(np.pi * i / 10)) for i in range(10)]),
    ("wsd", [0, .5] + [1] * 7 + [1, .7, .4])])
def test_each_schedule_warms_up_then_follows_its_closed_form(name, expected):
    s = optim.make_schedule(1.0, name, warmup_steps=2, total_steps=12, min_lr_ratio=0.1,
                            decay_fraction=0.25)
    np.testing.assert_allclose([float(s(i)) for i in range(12)], expected, atol=1e-6)
    if name != "constant":  # the decay ends at the run's end
        assert float(s(12)) == pytest.approx(0.1)


def test_wsd_decay_never_reaches_into_the_warmup():
    s = optim.make_schedule(1.0, "wsd", warmup_steps=8, total_steps=10, decay_fraction=0.5)
    assert [round(float(s(i)), 6) for i in (4, 8, 9, 10)] == [0.5, 1.0, 0.5, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wsd", "warmup-cosine", "warmup-linear"])
def test_a_resumed_schedule_continues_exactly(tmp_path, capsys, monkeypatch, name):
    """Stopped by a signal after its step-10 checkpoint of 20 and resumed on
    another device count: the learning rate of every logged step is the
    schedule's, and the params are the uninterrupted run's (the schedule
    reads the count in the optimizer state, which the checkpoint holds)."""
    import json
    import os
    import signal

    from dpax.cli import main
    from dpax.training.hooks import Checkpoint

    save = Checkpoint.save

    def stop_after_10(self, step):
        saved = save(self, step)
        if step == 10:
            os.kill(os.getpid(), signal.SIGUSR1)  # what a scheduler's preemption sends
        return saved

    flags = ["--model", "mlp", "--optimizer", "adam", "--lr", "0.01", "--batch-size", "61",
             "--log-every", "1", "--steps", "20", "--schedule", name, "--warmup-steps", "3",
             "--min-lr-ratio", "0.1"]
    ref, ck, out = (str(tmp_path / n) for n in ("ref", "ck", "run"))
    assert main(["train", *flags, "--devices", "2", "--out", ref]) == 0
    monkeypatch.setattr(Checkpoint, "save", stop_after_10)
    assert main(["train", *flags, "--devices", "2", "--checkpoint-dir", ck,
                 "--checkpoint-every", "10", "--out", str(tmp_path / "first")]) == 4
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["train", *flags, "--devices", "4", "--resume", f"{ck}/10", "--out", out]) == 0
    schedule = optim.make_schedule(0.01, name, 3, 20, min_lr_ratio=0.1)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert sorted(lrs) == list(range(11, 21))
    np.testing.assert_allclose([lrs[s] for s in range(11, 21)],
                               [float(schedule(s - 1)) for s in range(11, 21)], rtol=1e-6)
    with np.load(f"{ref}/params.npz") as a, np.load(f"{out}/params.npz") as b:
        diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
    print(f"{name}: resumed on 4 vs uninterrupted on 2, max |diff| {diff:.2e}")
    assert diff <= 1e-6


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


def test_state_stored_in_bf16_rounds_the_state_once_per_step_and_updates_in_f32():
    """Against optax's own Adam: the state after a step is Adam's, rounded to
    bf16; the next update is Adam's from that rounded state, in f32; the
    count stays an integer."""
    adam = optax.adam(1e-2)
    stored = optim.state_stored_in(adam, jnp.bfloat16)
    params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)}
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 3)) / 7, params) for i in range(3)]

    state = stored.init(params)
    for g in grads:
        want, want_state = adam.update(g, jax.tree.map(
            lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a,
            state), params)
        got, state = stored.update(g, state, params)
        np.testing.assert_array_equal(got["w"], want["w"])
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
            if jnp.issubdtype(b.dtype, jnp.floating):
                assert a.dtype == jnp.bfloat16
                np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))
            else:
                assert a.dtype == b.dtype and a == b
    assert float(jnp.max(jnp.abs(state[0].mu["w"].astype(jnp.float32)
                                 - want_state[0].mu["w"]))) > 0  # it did round


def test_an_ignored_option_is_refused_for_a_new_run_only():
    """A new run refuses an option its model or optimizer ignores (the CLI,
    tests/test_cli.py); a config saved with one, before that was refused,
    still validates, so its checkpoints load and resume."""
    from dpax import config as cfg
    from dpax.models.registry import ModelConfig
    from dpax.training.optim import OptimizerConfig

    model = cfg.validate(ModelConfig(name="mlp", dropout=0.5, heads=3))
    assert model.ignored() == ("`heads` is an option of `model=gpt` and `model=llama`, not "
                               "of `model=mlp`")
    assert cfg.validate(ModelConfig(name="gpt", dropout=0.5)).ignored() is None
    opt = cfg.validate(OptimizerConfig(name="adam", weight_decay=0.01))
    assert "`weight_decay` is an option of `optimizer=adamw`" in opt.ignored()
    assert cfg.validate(OptimizerConfig(name="adamw", weight_decay=0.01)).ignored() is None
    optim.make_optimizer("adam", optim.make_schedule(0.1), weight_decay=0.01)  # as before
