"""Uneven data: every example of an epoch counts exactly once, on any device count."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dpax
from dpax import data, models
from dpax.models import losses
from dpax.models.losses import for_task
from dpax.training import optim

N_EXAMPLES = 300


def seen_loss(model, batch):
    """Zero loss; the per-example metric is a one-hot of the example's index."""
    out = model(batch["x"])[:, 0]
    seen = jax.nn.one_hot(batch["x"][:, 0].astype(jnp.int32), N_EXAMPLES)
    return 0.0 * out, {"seen": seen}


@pytest.mark.parametrize("n,backend", [(8, "shard_map"), (4, "pmap"), (3, "shard_map")])
def test_every_example_counts_once_per_epoch(n, backend):
    x = np.arange(N_EXAMPLES, dtype=np.float32)[:, None]
    y = np.zeros(N_EXAMPLES, np.float32)
    model = models.Linear((1,), 1, rngs=nnx.Rngs(0))
    t = dpax.Trainer(model, seen_loss, optim.make_optimizer("sgd", optim.make_schedule(0.1)),
                     devices=n, backend=backend)
    batch_size = 61  # 300 = 4 * 61 + 56: every epoch ends with a partial batch
    spe = -(-N_EXAMPLES // batch_size)
    rows = t.fit(x, y, batch_size=batch_size, epochs=2, log_every=spe)
    assert len(rows) == 2
    for row in rows:
        assert row["examples"] == N_EXAMPLES
        np.testing.assert_allclose(row["seen"] * row["examples"], np.ones(N_EXAMPLES), atol=1e-4)


@functools.cache
def digits_trainer(n):
    ds = data.digits()
    model = models.make_model("cnn", ds.input_shape, ds.n_out, seed=0)
    loss_fn, predict_fn = for_task(ds.task)
    return dpax.Trainer(model, loss_fn, optim.make_optimizer("sgd", optim.make_schedule(0.1)),
                        devices=n, predict_fn=predict_fn)


def test_eval_and_predict_count_all_1797_digits_on_8_devices():
    ds = data.digits()
    x = np.concatenate([ds.x_train, ds.x_eval])
    y = np.concatenate([ds.y_train, ds.y_eval])
    assert len(x) == 1797
    t8, t1 = digits_trainer(8), digits_trainer(1)
    ev8, ev1 = t8.evaluate(x, y, batch_size=100), t1.evaluate(x, y, batch_size=100)
    assert ev8["examples"] == 1797
    assert abs(ev8["loss"] - ev1["loss"]) < 1e-5 and ev8["accuracy"] == ev1["accuracy"]
    p8, p1 = t8.predict(x, batch_size=100), t1.predict(x, batch_size=100)
    assert p8.shape == (1797,)
    np.testing.assert_array_equal(p8, p1)
    # The eval accuracy is the mean of the predictions' hits: nothing double counted.
    assert ev8["accuracy"] == pytest.approx(np.mean(p8 == y), abs=1e-6)


def test_a_loss_that_returns_a_mean_is_refused():
    ds = data.digits()
    t = dpax.Trainer(models.make_model("mlp", ds.input_shape, ds.n_out, 0),
                     lambda m, b: losses.classification_loss(m, b)[0].mean(),
                     optim.make_optimizer("sgd", optim.make_schedule(0.1)), devices=2)
    with pytest.raises(dpax.DpaxError, match="one loss per example"):
        t.fit(ds.x_train, ds.y_train, batch_size=8, until_step=1)


def test_a_loss_of_integers_is_refused():
    """A count of mistakes per example, cast to float32 for the sums, trained
    silently with a gradient of 0 (params unchanged, loss logged)."""
    ds = data.digits()

    def mistakes(model, batch):
        wrong = losses.classification_loss(model, batch)[0] > 0.5
        return wrong.astype(jnp.int32)

    t = dpax.Trainer(models.make_model("mlp", ds.input_shape, ds.n_out, 0), mistakes,
                     optim.make_optimizer("sgd", optim.make_schedule(0.1)), devices=2)
    with pytest.raises(dpax.DpaxError, match="floating-point losses, got int32"):
        t.fit(ds.x_train, ds.y_train, batch_size=8, until_step=1)
    assert int(t.state.step) == 0
    # Evaluated, not trained on, it is a count like any metric.
    assert 0.0 <= t.evaluate(ds.x_eval, ds.y_eval, batch_size=64)["loss"] <= 1.0
