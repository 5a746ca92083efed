"""Any optax transformation trains a sharded state as on one device.

The sharded layouts run the optimizer on the params, gradients and optimizer
state in their logical shapes and tree, under jit (`dpax.parallel.layout`), so
transformations that look at a leaf's shape (masks by ndim, factored
moments, per-row accumulators), at a layer as a whole (trust ratios, unitwise
clipping, orthogonalization) or at the whole tree (a global norm) compute
what they compute on one device. The reference is always one replicated
device with the same global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import max_diff
from dpax.errors import DpaxError

BATCH = 61  # uneven for every N below
STEPS = 15
TOL = 1e-5


class LayerNormMLP(nnx.Module):
    """13 -> 23 -> 7 with a LayerNorm: no size divides 3, 5 or 8, and leaves
    of every rank the transformations below treat differently."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(13, 23, rngs=rngs)
        self.norm = nnx.LayerNorm(23, rngs=rngs)
        self.dense2 = nnx.Linear(23, 7, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.norm(self.dense1(x))))


def data(n=400):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 13)).astype(np.float32)
    y = (np.argmax(x[:, :7] + 0.5 * x[:, 6:], -1)).astype(np.int32)
    return x, y


def by_ndim(params):
    return jax.tree.map(lambda p: "matrix" if p.ndim > 1 else "vector", params)


# name -> a fresh transformation. Each looks at shapes, layers or the whole tree.
TRANSFORMS = {
    "adamw-mask": lambda: optax.adamw(3e-3, weight_decay=0.1,
                                      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    "clip-global-norm": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(3e-3)),
    "lamb": lambda: optax.lamb(3e-3),
    "lars": lambda: optax.lars(0.1),
    "multi-transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(3e-3), "vector": optax.sgd(0.05)}, by_ndim),
    "adafactor": lambda: optax.adafactor(3e-3),
    "adafactor-factored": lambda: optax.adafactor(3e-3, min_dim_size_to_factor=8),
    "sm3": lambda: optax.sm3(0.1),
    "muon": lambda: optax.contrib.muon(3e-3),
    "adaptive-grad-clip": lambda: optax.chain(optax.adaptive_grad_clip(0.01),
                                              optax.sgd(0.05)),
    "clip-block-rms": lambda: optax.chain(optax.clip_by_block_rms(0.01), optax.sgd(0.05)),
    "centralize": lambda: optax.chain(optax.centralize(), optax.adam(3e-3)),
    "prodigy": lambda: optax.contrib.prodigy(1.0, estim_lr0=1e-3),
    "schedule-free": lambda: optax.contrib.schedule_free_adamw(3e-3),
    "multi-steps": lambda: optax.MultiSteps(optax.adam(3e-3), every_k_schedule=3),
    "apply-if-finite": lambda: optax.apply_if_finite(optax.adam(3e-3), 3),
    # Declares extra arguments and takes none: called without `value`.
    "sam": lambda: optax.contrib.sam(optax.sgd(0.05), optax.sgd(0.05), sync_period=2),
    "reduce-on-plateau": lambda: optax.chain(
        optax.adam(3e-3), optax.contrib.reduce_on_plateau(patience=2, cooldown=1,
                                                          accumulation_size=2)),
}


def params_after(name, n, sharding="replicated", seed=0):
    x, y = data()
    model = LayerNormMLP(nnx.Rngs(seed))
    t = dpax.Trainer(model, dpax.classification_loss, TRANSFORMS[name](), devices=n,
                     sharding=sharding)
    t.fit(x, y, batch_size=BATCH, until_step=STEPS, seed=seed)
    return jax.tree.leaves(t.params)


_reference = {}


def one_device(name, seed=0):
    if (name, seed) not in _reference:
        _reference[name, seed] = params_after(name, 1, seed=seed)
    return _reference[name, seed]


# Every transformation fully sharded on 3 devices; ZeRO-1 runs the same update
# (the optimizer on the logical tree under jit), so a few cover it; other Ns
# for the ones most sensitive to how leaves are split. scripts/optax_table.py
# measures every transformation x layout x N = 3, 5, 8. `make test` takes one
# of each kind (a mask by ndim, a global norm, a per-layer trust ratio, a
# factored moment, a tree split by label, the loss as `value`, a state that
# counts steps); the rest are `slow`.
CASES = [(name, "full", 3) for name in TRANSFORMS] + [
    ("adamw-mask", "full", 5), ("clip-global-norm", "full", 8), ("lamb", "optimizer", 5),
    ("adafactor-factored", "full", 8), ("muon", "full", 5), ("multi-transform", "full", 8),
    ("adafactor", "optimizer", 8), ("clip-global-norm", "optimizer", 3),
    ("sm3", "optimizer", 8), ("sam", "replicated", 2)]
MAIN = {("adamw-mask", "full", 3), ("clip-global-norm", "full", 8), ("lamb", "optimizer", 5),
        ("adafactor-factored", "full", 8), ("multi-transform", "full", 8),
        ("reduce-on-plateau", "full", 3), ("multi-steps", "full", 3), ("sam", "replicated", 2)}


@pytest.mark.parametrize("name,sharding,n", [c if c in MAIN else pytest.param(
    *c, marks=pytest.mark.slow) for c in CASES])
def test_any_optax_transformation_equals_one_device(name, sharding, n):
    diff = max_diff(params_after(name, n, sharding), one_device(name))
    print(f"{name} {sharding} x{n}: {diff:.1e}")
    assert diff <= TOL
    start = jax.tree.leaves(nnx.state(LayerNormMLP(nnx.Rngs(0)), nnx.Param))
    assert max_diff(one_device(name), start) > 1e-3  # not equal by standing still


@pytest.mark.slow  # reads every one-device reference
def test_the_transformations_train():
    """The references are not trivially equal: each moved the params."""
    x, y = data()
    start = jax.tree.leaves(nnx.state(LayerNormMLP(nnx.Rngs(0)), nnx.Param))
    for name in TRANSFORMS:
        assert max_diff(one_device(name), start) > 1e-3, name


# Slow: `make test` runs both on seed 0 above (clip-global-norm-full-8,
# adamw-mask-full-3).
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)])
def test_a_global_norm_clip_and_a_weight_decay_mask_with_other_seeds(seed):
    for name in ("clip-global-norm", "adamw-mask"):
        diff = max_diff(params_after(name, 8, "full", seed), one_device(name, seed))
        print(f"{name} full x8 seed {seed}: {diff:.1e}")
        assert diff <= TOL


def test_a_transformation_that_needs_the_loss_function_is_refused_up_front():
    """A line search evaluates the loss at trial params: dpax cannot give it that
    function, so the Trainer refuses it before training, in one line."""
    model = LayerNormMLP(nnx.Rngs(0))
    for tx in (optax.chain(optax.sgd(0.1), optax.scale_by_backtracking_linesearch(5)),
               optax.lbfgs()):
        with pytest.raises(DpaxError, match="value_fn"):
            dpax.Trainer(model, dpax.classification_loss, tx, devices=2)


def test_a_transformation_whose_update_fails_on_the_params_is_refused_up_front():
    """optax.lookahead wants its params wrapped (LookaheadParams): it failed
    in Trainer() with Flax's AttributeError; now one DpaxError line says why."""
    tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    with pytest.raises(DpaxError, match=r"fails on the model's params and gradients "
                                        r"\(AttributeError: .*LookaheadParams") as e:
        dpax.Trainer(LayerNormMLP(nnx.Rngs(0)), dpax.classification_loss, tx, devices=2)
    assert "\n" not in str(e.value)


def test_the_optimizer_sees_the_logical_tree_and_the_loss():
    """What the transformation's update receives, on 3 devices fully sharded:
    the params, gradients and state of one device, and the batch's mean loss
    as `value`."""
    seen = {}

    def spy():
        def init(params):
            return optax.EmptyState()

        def update(updates, state, params=None, *, value=None, **_):
            seen["shapes"] = jax.tree.map(jnp.shape, updates)
            jax.debug.callback(lambda v: seen.__setitem__("value", float(v)), value)
            return jax.tree.map(lambda g: -0.1 * g, updates), state

        return optax.GradientTransformationExtraArgs(init, update)

    x, y = data()
    model = LayerNormMLP(nnx.Rngs(0))
    want = jax.tree.map(jnp.shape, nnx.state(model, nnx.Param))
    t = dpax.Trainer(model, dpax.classification_loss, spy(), devices=3, sharding="full")
    rows = t.fit(x, y, batch_size=BATCH, until_step=1, log_every=1)
    assert seen["shapes"] == want
    assert seen["value"] == pytest.approx(rows[0]["loss"], rel=1e-6)
