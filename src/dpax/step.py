"""The per-device step functions: plain functions of ONE device's shard.

Each takes the replicated `TrainState` and a masked shard and calls collectives
on the named axis `AXIS`; a backend (`pmap` or `jit(shard_map)`) only wraps them.
The training step sums masked per-example losses and gradients, all-reduces
the sums and the example count in one `psum`, and divides once: the global-batch
mean exactly, even when shards hold different numbers of real examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from dpax.collectives import pmean_packed, psum_packed
from dpax.cpu_backward import for_xla_cpu
from dpax.layers import BatchContext, batch_context
from dpax.layout import AXIS, Replicated
from dpax.metrics import Count, Last, Mean, Total

# loss_fn(model, batch) -> per-example losses, or (losses, {name: per-example values}),
# or (losses, metrics, per-example weights): then the loss and the metrics are
# weighted means, sum(w * l) / sum(w) over the global batch (e.g. w = real tokens).
LossFn = Callable[[nnx.Module, dict], Any]


@struct.dataclass
class TrainState:
    """Everything a step changes: one logical copy, replicated on every device."""

    step: jax.Array
    params: nnx.State  # nnx.Param variables: what the optimizer updates
    model_state: nnx.State  # every other model variable (e.g. batch statistics)
    opt_state: optax.OptState
    bad_in_a_row: jax.Array  # consecutive steps skipped for a non-finite loss or gradient
    rng: jax.Array  # raw key data; step keys are fold_in(rng, step): N-independent
    # Exponential moving average of the params (laid out like them), or None.
    ema: nnx.State | None = None


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the training step computes; none of these change what it computes
    beyond float rounding (bf16 compute and bf16 all-reduce round more)."""

    grad_accum: int = 1  # micro-batches per device shard, summed inside the step
    compute_dtype: Any = None  # e.g. jnp.bfloat16 for forward/backward; params stay f32
    allreduce_dtype: Any = None  # e.g. jnp.bfloat16 halves the gradient bytes reduced
    skip_nonfinite: bool = True  # a NaN/inf loss or gradient leaves the state unchanged
    average_state: bool = False  # pmean non-param model state (per-device batch stats)
    clip_norm: float | None = None  # clip the mean gradient to this global norm
    ema_decay: float | None = None  # keep an EMA of the params with this decay
    # XLA:CPU: the backward pass rewritten so that weight gradients run on the
    # fast dot kernels and remat saves memory (`dpax.cpu_backward`).
    cpu_backward: bool = False
    # Where the state lives and how the update runs (`dpax.layout`).
    layout: Replicated = dataclasses.field(default_factory=Replicated)


def init_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int = 0,
               layout: Replicated | None = None, ema: bool = False):
    """Split a model into its static graph and a `TrainState`, laid out by
    `layout` (default: replicated); `ema`: with an EMA of the params, which
    starts as a copy of them."""
    layout = layout or Replicated()
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    # Separate buffers: one buffer in two donated fields would be donated twice.
    step, bad = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    rng = jax.random.key_data(jax.random.key(seed))
    average = jax.tree.map(lambda a: jnp.array(a, copy=True), params) if ema else None
    state = TrainState(step, params, model_state, None, bad, rng, average)
    return graphdef, layout.physical(state, tx)


def ema_update(ema, params, step, decay: float):
    """The EMA after `step` (0-based) with `params`: its decay ramps up as
    min(decay, (1 + step) / (10 + step)) (TensorFlow's `num_updates` rule), so
    the first updates do not pin the average to the initial params."""
    t = step.astype(jnp.float32)
    d = jnp.minimum(jnp.float32(decay), (1.0 + t) / (10.0 + t))
    return jax.tree.map(lambda e, p: d * e + (1.0 - d) * p.astype(e.dtype), ema, params)


def _with_index(batch: dict) -> dict:
    """Add each row's position in the global batch (device-major, as placed)."""
    rows = batch["mask"].shape[0]
    offset = jax.lax.axis_index(AXIS) * rows
    return {**batch, "index": offset + jnp.arange(rows, dtype=jnp.int32)}


def _context(batch: dict, key) -> BatchContext:
    return BatchContext(mask=batch["mask"], index=batch["index"], key=key, axis=AXIS)


def _losses_and_metrics(loss_fn: LossFn, model, batch):
    """(losses, metrics, weights or None) from whatever `loss_fn` returns."""
    out = loss_fn(model, batch)
    if not isinstance(out, tuple):
        out = (out,)
    if not 1 <= len(out) <= 3:
        raise ValueError(f"loss_fn must return losses, (losses, metrics) or (losses, metrics, "
                         f"weights), got a tuple of {len(out)}")
    losses, metrics, weights = out + ({}, None)[len(out) - 1:]
    return losses, dict(metrics), weights


def _masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over the real rows of the batch axis; trailing axes are kept, so a
    per-example vector (say a one-hot of the class) sums to a histogram."""
    mask = mask.reshape(mask.shape + (1,) * (values.ndim - 1))
    # `where`, not multiply: a NaN on a padded row must not leak into the sum.
    return jnp.sum(jnp.where(mask, values.astype(jnp.float32), 0.0), axis=0)


_EXAMPLES = "_examples"  # the example count among the sums, when losses are weighted


def _sums(loss_fn, model, batch):
    """(weighted loss sum, weight sum, {metric: weighted sum}) over the real
    rows of a shard; the weight of an example is 1 unless `loss_fn` gives one.
    With weights, `sums` also holds the example count as "examples"."""
    losses, metrics, weights = _losses_and_metrics(loss_fn, model, batch)
    mask = batch["mask"]
    for name, v in (("loss", losses), ("weight", weights)):
        if v is not None and jnp.shape(v) != mask.shape:  # a mean would break exactness
            raise ValueError(
                f"loss_fn must return one {name} per example, shape {mask.shape}, got "
                f"{jnp.shape(v)}; return per-example values before taking the mean")
    ones = jnp.ones(mask.shape, jnp.float32)
    w = None if weights is None else weights.astype(jnp.float32)

    def weighted(v):
        v = v.astype(jnp.float32)
        return v if w is None else v * w.reshape(w.shape + (1,) * (v.ndim - 1))

    # The loss, the weights (the count) and every per-example scalar metric in
    # ONE masked reduction: on a small model each separate reduction is a
    # kernel launch that costs as much as its math.
    scalar = [k for k, v in metrics.items() if jnp.shape(v) == mask.shape]
    cols = [weighted(losses), ones if w is None else w] + [weighted(metrics[k]) for k in scalar]
    if w is not None:
        cols.append(ones)
    totals = _masked_sum(jnp.stack(cols, axis=1), mask)
    sums = {k: totals[2 + i] for i, k in enumerate(scalar)}
    sums.update({k: _masked_sum(weighted(v), mask) for k, v in metrics.items()
                 if k not in scalar})
    if w is not None:
        sums[_EXAMPLES] = totals[-1]
    return totals[0], totals[1], sums


def _cast_floats(tree, dtype):
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
    options: StepOptions = StepOptions(),
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The per-device training step: `(state, shard) -> (state, metrics)`, the
    metrics typed (`dpax.metrics`) and the same on every replica."""
    n_micro = options.grad_accum
    layout = options.layout

    def train_step(state: TrainState, batch: dict):
        # What this device's loss sum is differentiated by, and how the model's
        # params come from it (the layout's: e.g. all-gathered slices).
        wrt, use = layout.grad_target(state.params, options.compute_dtype,
                                      options.allreduce_dtype)

        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        batch = _with_index(batch)

        def sums_and_grads(model_state, micro):
            def local_loss_sum(params):
                # Fresh Variable objects at this trace level: NNX refuses to update
                # (e.g. BatchNorm's running averages) Variables from an outer trace.
                fresh = jax.tree.map(lambda a: a, model_state)
                model = nnx.merge(graphdef, _cast_floats(use(params), options.compute_dtype),
                                  fresh)
                model.train()  # batch statistics and dropout on
                micro_in = {**micro, "x": _cast_floats(micro["x"], options.compute_dtype)}
                with batch_context(_context(micro_in, step_key)):
                    loss_sum, count, sums = _sums(loss_fn, model, micro_in)
                _, _, new_state = nnx.split(model, nnx.Param, ...)
                # Model state keeps its own dtype whatever the compute dtype was.
                new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, model_state)
                return loss_sum, (count, sums, new_state)

            grad_fn = jax.value_and_grad(local_loss_sum, has_aux=True)
            if options.cpu_backward:
                grad_fn = for_xla_cpu(grad_fn)
            (loss_sum, (count, sums, model_state)), grads = grad_fn(wrt)
            return (loss_sum, count, sums, grads), model_state

        if n_micro == 1:
            (loss_sum, count, sums, grad_sums), model_state = sums_and_grads(
                state.model_state, batch)
        else:
            # The shard's micro-batches, summed in a scan: activations of one
            # micro-batch live at a time, and the all-reduce below still runs once.
            micro = jax.tree.map(lambda v: v.reshape((n_micro, -1) + v.shape[1:]), batch)
            first = jax.tree.map(lambda v: v[0], micro)
            acc, model_state = sums_and_grads(state.model_state, first)

            def accumulate(carry, mb):
                acc, model_state = carry
                new, model_state = sums_and_grads(model_state, mb)
                return (jax.tree.map(jnp.add, acc, new), model_state), None

            (acc, model_state), _ = jax.lax.scan(
                accumulate, (acc, model_state), jax.tree.map(lambda v: v[1:], micro))
            loss_sum, count, sums, grad_sums = acc

        if options.average_state:
            # Per-device batch statistics: average them so replicas stay identical.
            leaves, treedef = jax.tree.flatten(model_state)
            floats = [i for i, r in enumerate(leaves) if jnp.issubdtype(r.dtype, jnp.floating)]
            for i, mean in zip(floats, pmean_packed([leaves[i] for i in floats], AXIS)):
                leaves[i] = mean
            model_state = jax.tree.unflatten(treedef, leaves)
        if not layout.grads_reduced:
            grad_sums = _cast_floats(grad_sums, options.allreduce_dtype)
        # A non-finite step leaves the state as it was, the counters aside: the
        # layout keeps the old params and optimizer state, the rest is kept here.
        # `finite` is reduced: the same on every replica.
        loss_sum, count, sums, params, opt_state, grad_norm, finite = (
            layout.reduce_and_update(tx, state, loss_sum, count, grad_sums, sums,
                                     options.clip_norm, options.skip_nonfinite))
        if options.skip_nonfinite:
            model_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), model_state,
                                       state.model_state)
            bad = jnp.where(finite, 0, state.bad_in_a_row + 1)
        else:
            bad = jnp.zeros_like(state.bad_in_a_row)
        ema = state.ema
        if options.ema_decay is not None:  # elementwise: any layout's slices
            ema = ema_update(ema, params, state.step, options.ema_decay)
            if options.skip_nonfinite:
                ema = jax.tree.map(lambda a, b: jnp.where(finite, a, b), ema, state.ema)
        new = state.replace(step=state.step + 1, params=params, model_state=model_state,
                            opt_state=opt_state, bad_in_a_row=bad, ema=ema)
        # A skipped step adds nothing to the logged means; it is counted instead.
        loss_sum, count, sums = jax.tree.map(lambda v: jnp.where(finite, v, 0.0),
                                             (loss_sum, count, sums))
        metrics = _example_metrics(loss_sum, count, sums)
        metrics["skipped"] = Total(1.0 - finite.astype(jnp.float32))
        metrics["bad_in_a_row"] = Last(new.bad_in_a_row)
        metrics["grad_norm"] = Last(grad_norm)
        if schedule is not None:
            metrics["lr"] = Last(jnp.asarray(schedule(state.step), jnp.float32))
        return new, metrics

    return train_step


def _example_metrics(loss_sum, count, sums: dict) -> dict:
    """The loss and every loss_fn metric as means over the examples counted
    (weighted means when the loss gave weights: then `count` is the weight
    sum, reported as "weight", and "examples" counts the examples)."""
    sums = dict(sums)
    if _EXAMPLES in sums:
        out = {"examples": Count(sums.pop(_EXAMPLES)), "weight": Total(count)}
    else:
        out = {"examples": Count(count)}
    return {"loss": Mean(loss_sum, count), **out,
            **{k: Mean(v, count) for k, v in sums.items()}}


def make_multi_step(step: Callable) -> Callable:
    """Several steps in one call: a scan of `step(state, acc, batch) -> (state,
    acc)` over batches stacked along a leading axis. For dispatch-bound models:
    one launch instead of one per step.

    Unrolled: inside an XLA:CPU loop a conv loses its thread pool (see
    benchmarks/README.md); unrolled, each step runs as fast as alone and the
    call compiles longer.
    """

    def multi_step(state: TrainState, acc, batches: dict):
        def body(carry, batch):
            return step(*carry, batch), None

        (state, acc), _ = jax.lax.scan(body, (state, acc), batches, unroll=True)
        return state, acc

    return multi_step


def eval_params(state: TrainState):
    """The params evaluation and sampling use: the EMA when the state keeps one."""
    return state.params if state.ema is None else state.ema


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn, layout: Replicated):
    """The per-device eval step: `(state, shard) -> metrics` of the global
    batch, with `eval_params`."""

    def eval_step(state: TrainState, batch: dict):
        model = nnx.merge(graphdef, layout.full_params(eval_params(state)), state.model_state)
        model.eval()  # running averages, no dropout
        batch = _with_index(batch)
        with batch_context(_context(batch, None)):
            loss_sum, count, sums = _sums(loss_fn, model, batch)
        return _example_metrics(*psum_packed((loss_sum, count, sums), AXIS))

    return eval_step


def make_predict_step(graphdef: nnx.GraphDef, predict_fn: Callable, layout: Replicated):
    """The per-device predict step: one output per example of the shard, with
    `eval_params`."""

    def predict_step(state: TrainState, batch: dict):
        model = nnx.merge(graphdef, layout.full_params(eval_params(state)), state.model_state)
        model.eval()
        return predict_fn(model, batch)

    return predict_step
