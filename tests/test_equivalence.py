"""The promise: N devices give the parameters of one device on the same global batch.

Batch sizes sit just off a multiple of N (N-1, N+1, 5N+1) and at 64, so every run
has shards with different numbers of real examples, and N-1 gives a device nothing
real at all.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import digits, max_diff
from dpax import models
from dpax.data.pipeline import BatchPlan
from dpax.models import losses
from dpax.training import optim
from reference import plain_jit_params

# `make test-tuned` runs these again with the opt-in XLA:CPU tuning.
pytestmark = pytest.mark.equivalence

STEPS = 10
TOL = 1e-5
# 1 against itself across backends; 2, the fewest devices that split a batch
# (N-1 = 1: a global batch of one example); 8, the most padding. N = 4 ran the
# same step with the same padding rules in between (other files train on 4).
DEVICE_COUNTS = [1, 2, 8]
BACKENDS = ["shard_map", "pmap"]
MAX_SEEN = {}  # (what, n, backend) -> largest difference measured, printed at the end


@pytest.fixture(scope="module", autouse=True)
def report_measured_differences():
    """Prints the largest differences measured (`pytest -s` shows them)."""
    yield
    for key, value in sorted(MAX_SEEN.items()):
        print(f"max |diff| {key}: {value:.2e}")


LR = {"sgd": 0.1, "momentum": 0.1, "adam": 0.01}


def make_trainer(n, backend, optimizer, batch_size):
    ds = digits()
    model = models.MLP(ds.input_shape, ds.n_out, hidden=16, rngs=nnx.Rngs(0))
    schedule = optim.make_schedule(LR[optimizer])
    tx = optim.make_optimizer(optimizer, schedule)
    return dpax.Trainer(model, losses.classification_loss, tx, devices=n, backend=backend,
                        schedule=schedule)


@functools.cache
def train(n, backend, optimizer, batch_size):
    """Params, per-step loss curve and the trainer after STEPS steps."""
    ds = digits()
    t = make_trainer(n, backend, optimizer, batch_size)
    rows = t.fit(ds.x_train, ds.y_train, batch_size=batch_size, until_step=STEPS, log_every=1)
    return jax.tree.leaves(t.params), np.array([r["loss"] for r in rows]), t


def batch_sizes(n, backend):
    sizes = [n + 1, 5 * n + 1] + ([64] if backend == "shard_map" else [])
    # N-1 gives a device nothing real; pmap runs the same per-device step.
    return ([n - 1] if n > 1 and backend == "shard_map" else []) + sizes


CASES = [(n, be, b) for n in DEVICE_COUNTS for be in BACKENDS for b in batch_sizes(n, be)]
# SGD on every case; an optimizer state (momentum) on the 8-device ones, where
# the most devices hold padding (Adam: the test below; any optax chain:
# test_optax_layouts.py).
OPTIMIZER_CASES = ([(*case, "sgd") for case in CASES]
                   + [(*case, "momentum") for case in CASES if case[0] == 8])


def _main_tier(case):
    """`make test` runs the default backend with SGD and Adam; pmap and
    momentum run in `make test-slow`."""
    n, backend = case[:2]
    return case if backend == "shard_map" and case[-1] != "momentum" else pytest.param(
        *case, marks=pytest.mark.slow)


@pytest.mark.parametrize("n,backend,batch_size,optimizer", [_main_tier(c) for c in OPTIMIZER_CASES])
def test_n_devices_equal_one_device(n, backend, batch_size, optimizer):
    ref, _, _ = train(1, "shard_map", optimizer, batch_size)
    got, _, trainer = train(n, backend, optimizer, batch_size)
    diff = max_diff(got, ref)
    key = ("params", n, backend)
    MAX_SEEN[key] = max(MAX_SEEN.get(key, 0.0), diff)
    assert diff <= TOL, f"{n} devices ({backend}) differ from 1 device by {diff:.2e}"
    assert dpax.pmap.replicas_in_sync(trainer.state)


@pytest.mark.parametrize("n,backend", [_main_tier((n, be)) for n in DEVICE_COUNTS
                                       for be in BACKENDS])
def test_adam_params_and_loss_curve_match_one_device(n, backend):
    batch_size = 5 * n + 1
    ref_params, ref, _ = train(1, "shard_map", "adam", batch_size)
    params, got, trainer = train(n, backend, "adam", batch_size)
    rel = float(np.max(np.abs(got - ref) / np.abs(ref)))
    diff = max_diff(params, ref_params)
    MAX_SEEN[("adam-loss-rel", n, backend)] = rel
    MAX_SEEN[("adam-params", n, backend)] = diff
    assert diff <= TOL, f"{n} devices ({backend}) differ from 1 device by {diff:.2e}"
    assert rel <= 1e-4
    assert dpax.pmap.replicas_in_sync(trainer.state)


def test_one_device_equals_a_plain_jit_loop():
    """The reference itself is right: a textbook jit loop on the mean loss."""
    ds = digits()
    batch_size = 41
    plan = BatchPlan(len(ds.x_train), batch_size, seed=0)
    batches = [(ds.x_train[plan.indices(s)], ds.y_train[plan.indices(s)]) for s in range(STEPS)]
    model = models.MLP(ds.input_shape, ds.n_out, hidden=16, rngs=nnx.Rngs(0))
    expected = plain_jit_params(model, optax.sgd(0.1), batches)
    got, _, _ = train(1, "shard_map", "sgd", batch_size)
    assert max_diff(got, expected) <= TOL


def test_one_compilation_per_run_even_with_a_partial_last_batch():
    ds = digits()
    batch_size = 100  # 1437 training examples: every epoch ends with a batch of 37
    for backend in BACKENDS:
        t = make_trainer(8, backend, "sgd", batch_size)
        t.fit(ds.x_train, ds.y_train, batch_size=batch_size, epochs=2, log_every=5)
        assert t.traces["train"] == 1, backend
        t.evaluate(ds.x_eval, ds.y_eval, batch_size=64)  # 360 = 5 * 64 + 40
        assert t.traces["eval"] == 1, backend


class _UnitNorm(nnx.Module):
    """A linear head on each input scaled to unit length: a row of zeros
    divides by zero, and its gradient is NaN even where the mask drops it."""

    def __init__(self, rngs: nnx.Rngs):
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(x / jnp.linalg.norm(x, axis=-1, keepdims=True))


def _inverse_count_loss(model, batch):
    """Each example weighed by 1 / its count (>= 1 in every example)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return ce, {}, 1.0 / batch["count"]


@pytest.mark.parametrize("seed", [0, 1])
def test_padding_is_as_finite_as_the_examples(seed):
    """Padded rows copy a real example: what the model and the loss compute
    on them is as finite as on the data. With rows of zeros, 4 devices
    (batch 34 padded to 36) trained NaN params where one device, which pads
    nothing, trained; with `skip_nonfinite` they skipped every step."""
    rng = np.random.default_rng(seed)
    data = {"x": rng.normal(size=(102, 8)).astype(np.float32), "y": rng.integers(0, 3, 102),
            "count": rng.integers(1, 5, 102).astype(np.float32)}
    for loss_fn in (losses.classification_loss, _inverse_count_loss):
        params = {}
        for n in (1, 4):
            t = dpax.Trainer(_UnitNorm(nnx.Rngs(seed)), loss_fn, optax.sgd(0.1), devices=n,
                             skip_nonfinite=True)
            rows = t.fit(data, batch_size=34, until_step=6, log_every=6)
            assert rows[-1]["skipped"] == 0, (loss_fn, n)
            params[n] = t.params
        assert all(np.isfinite(a).all() for a in jax.tree.leaves(params[4]))
        assert max_diff(params[4], params[1]) <= TOL
