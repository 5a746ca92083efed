"""The training state: everything a step changes, in the model's shapes (a
`Layout` lays it out on the devices), what it starts as, and its EMA."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from dpax.training.one_program import made_at_once

# What a model sows (`Module.sow`: `nnx.Intermediate`, `nnx.Perturbation`)
# is an output of the call that sowed it, not state a step carries: dpax's
# copy of the model holds none, each forward's sows are dropped once the
# loss has run, and the handback leaves the user's model's own alone.
SOWN = nnx.Intermediate
KEPT = nnx.Not(SOWN)


@struct.dataclass
class TrainState:
    """Everything a step changes, laid out on the devices by a `Layout`."""

    step: jax.Array
    params: nnx.State  # nnx.Param variables: what the optimizer updates
    model_state: nnx.State  # every other model variable (e.g. batch statistics)
    opt_state: optax.OptState
    bad_in_a_row: jax.Array  # consecutive skipped steps (non-finite, or no weight)
    rng: jax.Array  # raw key data; step keys are fold_in(rng, step): N-independent
    # Exponential moving average of the params (laid out like them), or None.
    ema: nnx.State | None = None


def field_spans(state: TrainState, leaves: list) -> dict[str, tuple[int, int, Any]]:
    """Each field's (start, stop, treedef) in `leaves`, `jax.tree.flatten(state)`'s
    list: a field is rebuilt from its own leaves without unflattening the rest."""
    spans, at = {}, 0
    for field in dataclasses.fields(state):
        part, treedef = jax.tree.flatten(getattr(state, field.name))
        if any(a is not b for a, b in zip(part, leaves[at:at + len(part)])):
            raise AssertionError(f"TrainState.{field.name} is not where its leaves are")
        spans[field.name] = (at, at + len(part), treedef)
        at += len(part)
    if at != len(leaves):
        raise AssertionError("TrainState's fields do not hold all of its leaves")
    return spans


def init_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int = 0,
               ema: bool = False):
    """Split a model into its static graph and a logical `TrainState` (one
    copy, in the model's shapes; `dpax.parallel.layout` lays it out); `ema`: with an
    EMA of the params, which starts as a copy of them."""
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    # Made on the host: on the model's device the optimizer state (Adam's
    # moments: twice the params) and the EMA would be whole there, before a
    # layout splits them over the devices.
    host = host_device()

    def fresh(params):
        opt_state = tx.init(params)
        # Separate buffers: one buffer in two donated fields would be donated twice.
        step, bad = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
        # In fp32 whatever the params' dtype: a bf16 average stops moving once
        # (1 - decay) times a step's change falls below half a bf16 unit.
        average = jax.tree.map(lambda a: jnp.array(
            a, jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype, copy=True),
            params) if ema else None
        return opt_state, step, bad, average

    with jax.default_device(host):
        on_host = jax.device_put(params, host)
        # Not in the program: one program serves every seed.
        rng = jax.random.key_data(jax.random.key(seed))
        opt_state, step, bad, average = made_at_once(fresh, on_host)
    return graphdef, TrainState(step, params, model_state, opt_state, bad, rng, average)


def host_device() -> jax.Device:
    """This process's CPU device (JAX always has one unless `JAX_PLATFORMS`
    leaves it out; then the default device)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def ema_update(ema, params, step, decay: float):
    """The EMA after `step` (0-based) with `params`: its decay ramps up as
    min(decay, (1 + step) / (10 + step)) (TensorFlow's `num_updates` rule), so
    the first updates do not pin the average to the initial params."""
    t = step.astype(jnp.float32)
    d = jnp.minimum(jnp.float32(decay), (1.0 + t) / (10.0 + t))
    return jax.tree.map(lambda e, p: (d * e + (1.0 - d) * p.astype(e.dtype)).astype(e.dtype),
                        ema, params)


def eval_params(state: TrainState):
    """The params evaluation and sampling use: the EMA when the state keeps one."""
    return state.params if state.ema is None else state.ema
