"""The per-device step functions: plain functions of ONE device's shard.

Each takes the replicated `TrainState` and a masked shard and calls collectives
on the named axis `AXIS`; a backend (`pmap` or `jit(shard_map)`) only wraps them.
The training step sums masked per-example losses and gradients, all-reduces
the sums and the example count in one `psum`, and divides once: the global-batch
mean exactly, even when shards hold different numbers of real examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

AXIS = "data"

# loss_fn(model, batch) -> per-example losses, or (losses, {name: per-example values})
LossFn = Callable[[nnx.Module, dict], Any]


@struct.dataclass
class TrainState:
    """Everything a step changes: one logical copy, replicated on every device."""

    step: jax.Array
    params: nnx.State  # nnx.Param variables: what the optimizer updates
    rest: nnx.State  # every other model variable (e.g. batch statistics)
    opt_state: optax.OptState


def init_state(model: nnx.Module, tx: optax.GradientTransformation):
    """Split a model into its static graph and a `TrainState`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, rest, tx.init(params))


def _losses_and_metrics(loss_fn: LossFn, model, batch) -> tuple[jax.Array, dict]:
    out = loss_fn(model, batch)
    losses, metrics = out if isinstance(out, tuple) else (out, {})
    return losses, dict(metrics)


def _masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over the real rows of the batch axis; trailing axes are kept, so a
    per-example vector (say a one-hot of the class) sums to a histogram."""
    mask = mask.reshape(mask.shape + (1,) * (values.ndim - 1))
    # `where`, not multiply: a NaN on a padded row must not leak into the sum.
    return jnp.sum(jnp.where(mask, values.astype(jnp.float32), 0.0), axis=0)


def _sums(loss_fn, model, batch):
    losses, metrics = _losses_and_metrics(loss_fn, model, batch)
    mask = batch["mask"]
    if losses.shape != mask.shape:  # a per-device mean would break exactness
        raise ValueError(
            f"loss_fn must return one loss per example, shape {mask.shape}, got "
            f"{losses.shape}; return losses before taking the mean"
        )
    sums = {f"{k}_sum": _masked_sum(v, mask) for k, v in metrics.items()}
    return _masked_sum(losses, mask), sums


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The per-device training step: `(state, shard) -> (state, metric sums)`."""

    def train_step(state: TrainState, batch: dict):
        def local_loss_sum(params):
            model = nnx.merge(graphdef, params, state.rest)
            loss_sum, sums = _sums(loss_fn, model, batch)
            _, _, rest = nnx.split(model, nnx.Param, ...)
            return loss_sum, (sums, rest)

        # Differentiate this device's own loss sum. Without the cast, shard_map
        # would transpose the replicated params into an implicit psum, and the
        # explicit one below would count every gradient N times.
        local_params = jax.lax.pcast(state.params, AXIS, to="varying")
        (loss_sum, (sums, rest)), grad_sums = jax.value_and_grad(local_loss_sum, has_aux=True)(
            local_params
        )
        count = jnp.sum(batch["mask"].astype(jnp.float32))
        # One all-reduce for everything: sums add up exactly across devices.
        loss_sum, count, grad_sums, sums = jax.lax.psum((loss_sum, count, grad_sums, sums), AXIS)
        grads = jax.tree.map(lambda g: g / count, grad_sums)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss_sum": loss_sum, "count": count, **sums}
        metrics["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        new = state.replace(step=state.step + 1, params=params, rest=rest, opt_state=opt_state)
        return new, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn):
    """The per-device eval step: `(state, shard) -> summed loss, count, metrics`."""

    def eval_step(state: TrainState, batch: dict):
        model = nnx.merge(graphdef, state.params, state.rest)
        loss_sum, sums = _sums(loss_fn, model, batch)
        count = jnp.sum(batch["mask"].astype(jnp.float32))
        return jax.lax.psum({"loss_sum": loss_sum, "count": count, **sums}, AXIS)

    return eval_step


def make_predict_step(graphdef: nnx.GraphDef, predict_fn: Callable):
    """The per-device predict step: one output per example of the shard."""

    def predict_step(state: TrainState, batch: dict):
        return predict_fn(nnx.merge(graphdef, state.params, state.rest), batch)

    return predict_step
