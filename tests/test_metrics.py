"""Typed metrics (`dpax.training.metrics`): how each kind adds up over steps, packed on
the device and reduced on the host, against plain sums."""

import jax
import jax.numpy as jnp
import numpy as np

from dpax.training import metrics
from dpax.training.metrics import Count, Last, Mean, Total


def step_metrics(loss_sum, count, hist, lr):
    return {"loss": Mean(jnp.float32(loss_sum), jnp.float32(count)),
            "examples": Count(jnp.float32(count)),
            "skipped": Total(jnp.float32(0.0)),
            "hist": Mean(jnp.asarray(hist, jnp.float32), jnp.float32(count)),
            "lr": Last(jnp.float32(lr))}


def test_device_sums_equal_the_host_reduction_of_each_step():
    steps = [step_metrics(3.0, 4, [1, 2], 0.1), step_metrics(5.0, 2, [0, 1], 0.2),
             step_metrics(1.0, 6, [2, 2], 0.3)]
    packing = metrics.Packing(jax.eval_shape(lambda: steps[0]))
    sums = packing.zeros()
    fold = jax.jit(metrics.accumulate)
    for m in steps:
        sums = fold(m, sums)
    on_device = metrics.summarize(packing.unpack(jax.device_get(sums)))
    per_step = metrics.summarize([jax.device_get(m) for m in steps])
    assert on_device.keys() == per_step.keys()
    assert on_device["loss"] == per_step["loss"] == 9.0 / 12
    np.testing.assert_array_equal(on_device["hist"], [3 / 12, 5 / 12])
    assert on_device["examples"] == 12 and isinstance(on_device["examples"], int)
    assert on_device["lr"] == np.float32(0.3)  # the latest, not a sum
    assert on_device["skipped"] == 0.0


def test_the_scalars_travel_as_one_array():
    packed = metrics.pack(step_metrics(3.0, 4, [1, 2], 0.1))
    assert packed["scalars"].shape == (6,) and packed["scalars"].dtype == jnp.float32
    assert [a.shape for a in packed["arrays"]] == [(2,)]


def test_a_mean_over_no_examples_is_nan_not_zero():
    row = metrics.summarize({"loss": Mean(np.float32(0), np.float32(0)),
                             "examples": Count(np.float32(0))})
    assert np.isnan(row["loss"]) and row["examples"] == 0


def test_host_sums_are_float64():
    big = [{"n": Total(np.float32(2.0**24))}, {"n": Total(np.float32(1.0))}]
    assert metrics.summarize(big)["n"] == 2.0**24 + 1  # f32 would round it away
