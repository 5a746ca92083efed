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
