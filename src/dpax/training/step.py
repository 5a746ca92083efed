"""The step functions: the training step, evaluation and prediction.

The per-device parts are plain functions of ONE device's shard that call
collectives on the named axis `AXIS`; a backend (`pmap` or `jit(shard_map)`)
only wraps them. The training step sums masked per-example losses and
gradients, all-reduces the sums and the example count together, and divides
once: the global-batch mean exactly, even when shards hold different numbers
of real examples.

Where the update runs is the layout's (`dpax.parallel.layout`): per device for a
replicated state, or on the logical state under jit for a sharded one (then
only the gradients are computed per device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from dpax.errors import DpaxError
from dpax.models.layers import BatchContext, batch_context
from dpax.parallel import layout as layouts
from dpax.parallel.collectives import pmean_packed, psum_packed
from dpax.parallel.layout import Layout
from dpax.parallel.mesh import AXIS
from dpax.training.metrics import Count, Last, Mean, Total
from dpax.xla_cpu.backward import for_xla_cpu

# loss_fn(model, batch) -> per-example losses, or (losses, {name: per-example values}),
# or (losses, metrics, per-example weights): then the loss and the metrics are
# weighted means, sum(w * l) / sum(w) over the global batch (e.g. w = real tokens).
LossFn = Callable[[nnx.Module, dict], Any]


@struct.dataclass
class TrainState:
    """Everything a step changes, laid out on the devices by a `Layout`."""

    step: jax.Array
    params: nnx.State  # nnx.Param variables: what the optimizer updates
    model_state: nnx.State  # every other model variable (e.g. batch statistics)
    opt_state: optax.OptState
    bad_in_a_row: jax.Array  # consecutive steps skipped for a non-finite loss or gradient
    rng: jax.Array  # raw key data; step keys are fold_in(rng, step): N-independent
    # Exponential moving average of the params (laid out like them), or None.
    ema: nnx.State | None = None


@struct.dataclass
class Reduced:
    """One step's sums over the global batch, as the update takes them."""

    loss_sum: jax.Array
    count: jax.Array  # examples, or the loss's weights, summed
    sums: dict  # {metric: sum}
    grads: Any  # gradient sums, laid out as the layout's update takes them
    model_state: Any  # the model's new non-param state (e.g. running averages)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the training step computes. bf16 compute and a bf16 all-reduce round
    more; clipping, EMA and skipping non-finite steps are part of the result."""

    grad_accum: int = 1  # micro-batches per device shard, summed inside the step
    compute_dtype: Any = None  # e.g. jnp.bfloat16 for forward/backward; params stay f32
    allreduce_dtype: Any = None  # e.g. jnp.bfloat16 halves the gradient bytes reduced
    skip_nonfinite: bool = True  # a NaN/inf loss or gradient leaves the state unchanged
    average_state: bool = False  # pmean non-param model state (per-device batch stats)
    sync_batchnorm: bool = True  # Linen BatchNorm over the global batch (`dpax.models.bridge`)
    clip_norm: float | None = None  # clip the mean gradient to this global norm
    ema_decay: float | None = None  # keep an EMA of the params with this decay
    # XLA:CPU: the backward pass rewritten so that weight gradients run on the
    # fast dot kernels and remat saves memory (`dpax.xla_cpu.backward`).
    cpu_backward: bool = False


def init_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int = 0,
               ema: bool = False):
    """Split a model into its static graph and a logical `TrainState` (one
    copy, in the model's shapes; `dpax.parallel.layout` lays it out); `ema`: with an
    EMA of the params, which starts as a copy of them."""
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    # Separate buffers: one buffer in two donated fields would be donated twice.
    step, bad = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    rng = jax.random.key_data(jax.random.key(seed))
    average = jax.tree.map(lambda a: jnp.array(a, copy=True), params) if ema else None
    return graphdef, TrainState(step, params, model_state, tx.init(params), bad, rng, average)


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


def _context(batch: dict, key, sync_batchnorm: bool = True) -> BatchContext:
    return BatchContext(mask=batch["mask"], index=batch["index"], key=key, axis=AXIS,
                        sync_batchnorm=sync_batchnorm)


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


def _cast_inputs(batch: dict, dtype) -> dict:
    """The batch the model sees in the compute dtype: every floating-point
    entry but the targets `y` (a bf16 target would round the loss)."""
    return {k: v if k == "y" else _cast_floats(v, dtype) for k, v in batch.items()}


def make_grad_step(graphdef: nnx.GraphDef, loss_fn: LossFn, layout: Layout,
                   options: StepOptions = StepOptions()) -> Callable[[TrainState, dict], Reduced]:
    """The per-device part of a training step: `(state, shard) -> Reduced`,
    the sums over the global batch (the same on every device) and the
    gradient sums as `layout.reduce` leaves them. `state.opt_state` is unused."""
    n_micro = options.grad_accum
    dtypes = (options.compute_dtype, options.allreduce_dtype)

    def grad_step(state: TrainState, batch: dict) -> Reduced:
        # What this device's loss sum is differentiated by, and how the model's
        # params come from it (the layout's: e.g. all-gathered slices).
        wrt, use = layout.grad_target(state.params, dtypes)
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
                micro_in = _cast_inputs(micro, options.compute_dtype)
                with batch_context(_context(micro_in, step_key, options.sync_batchnorm)):
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
        if not getattr(layout, "grads_in_backward", False):
            grad_sums = _cast_floats(grad_sums, options.allreduce_dtype)
        loss_sum, count, sums, grads = layout.reduce(loss_sum, count, sums, grad_sums)
        return Reduced(loss_sum, count, sums, grads, model_state)

    return grad_step


def sum_of_squares(tree) -> jax.Array:
    """Sum of every squared element in f32: non-finite if any element is (or if
    the norm overflows f32, a gradient no step should apply either). One
    reduction per leaf: a concatenation of the leaves would be copied first."""
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


def _tx_update(tx, grads, opt_state, params, loss):
    """`tx.update` with the global batch's mean loss as `value` for the
    transformations that take extra arguments (e.g. reduce_on_plateau)."""
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return tx.update(grads, opt_state, params, value=loss)
    return tx.update(grads, opt_state, params)


def check_optimizer(tx: optax.GradientTransformation, state: TrainState) -> None:
    """Refuse, before training, a transformation the step cannot call: one
    that wants more than the gradients, params and the loss (a line search's
    `value_fn` evaluates the loss at trial params)."""
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32),
                         state.params)
    try:
        jax.eval_shape(lambda g, s, p: _tx_update(tx, g, s, p, jnp.float32(0)),
                       grads, state.opt_state, state.params)
    except TypeError as e:
        if "required keyword-only argument" not in str(e):
            raise
        wanted = str(e).rpartition("argument")[2].strip(": s")
        raise DpaxError(
            f"the optimizer's update needs {wanted}: dpax gives an optax update the "
            "gradients, params and the batch's mean loss (`value`), not a loss function "
            "(e.g. a line search: optax.scale_by_backtracking_linesearch, optax.lbfgs); "
            "use an optimizer without one") from None


def make_update(tx: optax.GradientTransformation, schedule: optax.Schedule | None = None,
                options: StepOptions = StepOptions()
                ) -> Callable[[TrainState, Reduced], tuple[TrainState, dict]]:
    """The update from a step's global sums: `(state, reduced) -> (state,
    metrics)`. The same math wherever it runs: per device on a replica of the
    state, or under jit on the logical state of a sharded layout (XLA then
    partitions it, collectives included)."""

    def update(state: TrainState, r: Reduced):
        # One pass over the summed gradients gives the norm and the finiteness
        # test (a NaN or inf anywhere makes the sum of squares non-finite); the
        # division then fuses into the update instead of being stored and read
        # twice more.
        sq = sum_of_squares(r.grads)
        norm = jnp.sqrt(sq) / r.count
        finite = jnp.isfinite(sq) & jnp.isfinite(r.loss_sum)

        def apply():
            grads = jax.tree.map(lambda g: g.astype(jnp.float32) / r.count, r.grads)
            if options.clip_norm is not None:  # optax.clip_by_global_norm's formula
                small = norm < options.clip_norm
                grads = jax.tree.map(
                    lambda g: jax.lax.select(small, g, g / norm * options.clip_norm), grads)
            updates, opt_state = _tx_update(tx, grads, state.opt_state, state.params,
                                            r.loss_sum / r.count)
            return optax.apply_updates(state.params, updates), opt_state

        model_state = r.model_state
        if options.skip_nonfinite:
            # A branch, not a select of new against old: the good path writes
            # the update once instead of making one more pass over params and
            # moments (and the donated buffers are updated in place). A
            # non-finite step leaves the state as it was, the counters aside.
            params, opt_state = jax.lax.cond(finite, apply,
                                             lambda: (state.params, state.opt_state))
            model_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), model_state,
                                       state.model_state)
            bad = jnp.where(finite, 0, state.bad_in_a_row + 1)
        else:
            params, opt_state = apply()
            bad = jnp.zeros_like(state.bad_in_a_row)
        ema = state.ema
        if options.ema_decay is not None:
            ema = ema_update(ema, params, state.step, options.ema_decay)
            if options.skip_nonfinite:
                ema = jax.tree.map(lambda a, b: jnp.where(finite, a, b), ema, state.ema)
        new = state.replace(step=state.step + 1, params=params, model_state=model_state,
                            opt_state=opt_state, bad_in_a_row=bad, ema=ema)
        # A skipped step adds nothing to the logged means; it is counted instead.
        loss_sum, count, sums = jax.tree.map(lambda v: jnp.where(finite, v, 0.0),
                                             (r.loss_sum, r.count, r.sums))
        metrics = _example_metrics(loss_sum, count, sums)
        metrics["skipped"] = Total(1.0 - finite.astype(jnp.float32))
        metrics["bad_in_a_row"] = Last(new.bad_in_a_row)
        metrics["grad_norm"] = Last(norm)
        if schedule is not None:
            metrics["lr"] = Last(jnp.asarray(schedule(state.step), jnp.float32))
        return new, metrics

    return update


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    layout: Layout,
    schedule: optax.Schedule | None = None,
    options: StepOptions = StepOptions(),
    per_device: Callable | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The training step `(state, batch) -> (state, metrics)`, the metrics
    typed (`dpax.training.metrics`).

    With a per-device update (`layout.per_device_update`) it is a per-device
    function of one shard, for a backend to wrap. Otherwise it is a function
    of the whole stored state and batch, for jit: `per_device(fn, in_specs,
    out_specs)` maps the gradient part over the devices (shard_map), and the
    update runs on the logical state.
    """
    grad_step = make_grad_step(graphdef, loss_fn, layout, options)
    update = make_update(tx, schedule, options)
    if layout.per_device_update:
        return lambda state, batch: update(state, grad_step(state, batch))

    # The gradient part reads neither the optimizer state nor the EMA.
    def inputs(tree):
        return tree.replace(opt_state=None, ema=None)

    rows, whole = P(AXIS), P()
    grads_of = per_device(
        grad_step, (inputs(layouts.specs(layout)), rows),
        Reduced(whole, whole, whole, jax.tree.map(lambda s: s.spec, layout.grad_splits), whole))

    def train_step(state: TrainState, batch: dict):
        r = grads_of(inputs(state), batch)
        r = r.replace(grads=jax.tree.map(lambda s, g: s.unpad(g), layout.grad_splits, r.grads))
        new, metrics = update(layouts.logical(layout, state), r)
        return layouts.stored(layout, new), metrics

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


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn, layout: Layout):
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


def make_predict_step(graphdef: nnx.GraphDef, predict_fn: Callable, layout: Layout):
    """The per-device predict step: one output per example of the shard, with
    `eval_params`."""

    def predict_step(state: TrainState, batch: dict):
        model = nnx.merge(graphdef, layout.full_params(eval_params(state)), state.model_state)
        model.eval()
        return predict_fn(model, batch)

    return predict_step
