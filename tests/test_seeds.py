"""What the seeds teach, on dpax: psum (seed 002), in_axes broadcasting (001),
linear regression (000) and Adam on the CNN (004)."""

import numpy as np
import pytest

import dpax
from dpax import data
from dpax.cli.train import TrainConfig, train


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_psum_over_devices_as_in_seed_002(backend):
    import jax

    n, per = 4, 4
    def scale_and_sum(x):
        scaled = x * 2
        return scaled, jax.lax.psum(scaled.sum(), "data")

    x = np.arange(n * per, dtype=np.float32).reshape(n, per)
    scaled, total = dpax.pmap.spmd(scale_and_sum, devices=n, backend=backend)(x)
    np.testing.assert_array_equal(np.asarray(scaled), x * 2)
    assert np.asarray(total).tolist() == [float((np.arange(n * per) * 2).sum())] * n


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_in_axes_broadcast_and_static_args_as_in_seed_001(backend):
    n = 4
    w = np.ones((3, 2), np.float32)
    x = np.arange(n * 5 * 3, dtype=np.float32).reshape(n, 5, 3)

    def predict(params, inputs, scale):
        return (inputs @ params) * scale

    f = dpax.pmap.spmd(predict, devices=n, in_axes=(None, 0, None), static_argnums=(2,),
                  backend=backend)
    np.testing.assert_allclose(np.asarray(f(w, x, 3.0)), (x @ w) * 3.0)


def test_spmd_with_nothing_mapped_still_runs():
    """`jax.pmap(f, in_axes=None)` fails on current JAX; dpax broadcasts."""
    out = dpax.pmap.spmd(lambda v: v + 1, devices=2, in_axes=None)(np.float32(1))
    assert np.asarray(out).tolist() == [2.0, 2.0]


def test_seed_000_regression_recovers_w_and_b_on_4_devices():
    cfg = TrainConfig.from_flags(
        model="linear", data="regression", devices=4, optimizer="sgd",
                           lr=0.05, batch_size=64, epochs=30, log_every=50)
    result = train(cfg, log=None)
    w_true, b_true = data.true_regression_params()
    params = result.trainer.params
    w = np.asarray(params["dense"]["kernel"][...])[:, 0]
    b = float(np.asarray(params["dense"]["bias"][...])[0])
    assert np.max(np.abs(w - w_true)) < 0.05 and abs(b - b_true) < 0.05
    assert result.eval["loss"] < 0.02  # noise variance is 0.01
