"""The step functions: the training step, evaluation and prediction.

The per-device parts are plain functions of ONE device's shard that call
collectives on the mesh axes of every device (`layout.axis`); a backend (`pmap` or `jit(shard_map)`)
only wraps them. The training step sums masked per-example losses and
gradients (`dpax.training.sums`), all-reduces the sums and the example count
together, and divides once in the update (`dpax.training.update`). On the
generic path a transformer's weight gradients, and a narrow head's, are
all-reduced before their last transpose, as jit's partitioner does
(`dpax.training.untransposed`).

As it is traced the step runs a preflight (`preflight`): the forward's part
of the gradient's trace, on one device's shapes, refuses what N devices would
train differently from one (`dpax.analysis.refusals`) and names the model
state to average.

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
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from dpax.analysis.refusals import Asks, numeric, refuse
from dpax.analysis.varying import typed_varying
from dpax.collectives import pmean_tree, psum_tree
from dpax.errors import DpaxError
from dpax.models.layers import BatchContext, batch_context
from dpax.parallel import layout as layouts
from dpax.parallel.layout import Layout
from dpax.training.compute import cast_floats, model_in
from dpax.training.state import SOWN, TrainState, eval_params
from dpax.training.sums import LossFn, example_metrics, shard_sums
from dpax.training.untransposed import ReduceBeforeTranspose
from dpax.training.update import Reduced, UpdateOptions, make_update


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What the training step computes beyond the loss's mean gradient (bf16
    rounding, clipping, an EMA, skipped non-finite steps), and how (the
    platform's choices: on XLA:CPU with its tuning, a dot's or a sum's form,
    which can round the last bits differently)."""

    grad_accum: int = 1  # micro-batches per device shard, summed inside the step
    compute_dtype: Any = None  # e.g. jnp.bfloat16 for forward/backward; params stay f32
    allreduce_dtype: Any = None  # e.g. jnp.bfloat16 halves the gradient bytes reduced
    skip_nonfinite: bool = False  # True: a NaN/inf loss or gradient leaves the state unchanged
    # The model holds numeric state that no synchronized layer owns: the step finds
    # which of it differs per device (refused unless sync_batchnorm is off, then averaged).
    average_state: bool = False
    # The model draws from RNG streams of its own (not dpax's dropout): the step
    # refuses draws from a key every device holds alike, shaped by the rows.
    own_random: bool = False
    sync_batchnorm: bool = True  # Linen BatchNorm over the global batch (`dpax.models.bridge`)
    clip_norm: float | None = None  # clip the mean gradient to this global norm
    ema_decay: float | None = None  # keep an EMA of the params with this decay
    # From `dpax.parallel.platform`: a wrapper of the per-device gradient
    # function (XLA:CPU's backward rewrite), and packed all-reduce operands.
    backward: Callable[[Callable], Callable] | None = None
    pack: bool = False


def _with_index(batch: dict, axis) -> dict:
    """Add each row's position in the global batch (device-major, as placed
    over the mesh axes `axis`)."""
    rows = batch["mask"].shape[0]
    offset = jax.lax.axis_index(axis) * rows
    return {**batch, "index": offset + jnp.arange(rows, dtype=jnp.int32)}


def _context(batch: dict, key, axis, options: StepOptions) -> BatchContext:
    return BatchContext(mask=batch["mask"], index=batch["index"], key=key, axis=axis,
                        sync_batchnorm=options.sync_batchnorm, pack=options.pack)


def _cast_inputs(batch: dict, dtype) -> dict:
    """The batch the model sees in the compute dtype: every floating-point
    entry but the targets `y` (a bf16 target would round the loss)."""
    return {k: v if k == "y" else cast_floats(v, dtype) for k, v in batch.items()}


def make_grad_step(graphdef: nnx.GraphDef, loss_fn: LossFn, layout: Layout,
                   options: StepOptions = StepOptions()) -> Callable[[TrainState, dict], Reduced]:
    """The per-device part of a training step: `(state, shard) -> Reduced`,
    the sums over the global batch (the same on every device) and the
    gradient sums as `layout.reduce` leaves them. `state.opt_state` is unused."""
    dtypes = (options.compute_dtype, options.allreduce_dtype)

    def grad_step(state: TrainState, batch: dict) -> Reduced:
        # The generic path sums weight gradients before their transpose
        # (`dpax.training.untransposed`); the XLA:CPU tuning times its own
        # forms. One per trace: it learns what moved from the trace it wraps.
        reorder = (ReduceBeforeTranspose()
                   if options.backward is None and layout.sums_elementwise else None)
        # What this device's loss sum is differentiated by, and how the model's
        # params come from it (the layout's: e.g. all-gathered slices).
        wrt, use = layout.grad_target(state.params, dtypes)
        batch = _with_index(batch, layout.axis)
        forward = _forward(graphdef, loss_fn, use, _step_key(state), layout.axis, options)
        traced: list[ClosedJaxpr] = []  # the first micro-batch's, for the preflight
        sums_and_grads = _sums_and_grads(forward, wrt, reorder, options, traced)
        try:
            acc, model_state = _accumulate(sums_and_grads, state.model_state, batch,
                                           options.grad_accum)
        except Exception as error:
            # A refusal comes first: it says what to change for N devices.
            try:
                preflight(forward, wrt, state.model_state, batch, layout.axis, options)
            except DpaxError as refusal:
                raise refusal from None
            except Exception:  # the forward fails there too: the gradient's error says it
                pass
            raise error
        per_device = preflight(forward, wrt, state.model_state, batch, layout.axis, options,
                               *traced[:1])
        if options.average_state:
            model_state = _average_state(model_state, per_device, layout.axis, options.pack)
        return _reduce(layout, reorder, options, acc, model_state)

    def checked(state: TrainState, batch: dict) -> Reduced:
        try:
            return grad_step(state, batch)
        except TypeError as e:
            if not _carry_types_differ(e):
                raise
            raise DpaxError(
                "the model loops (a scan, e.g. nnx.RNN) with a carry that starts the same on "
                "every device and comes back computed from each device's rows, which "
                "jax.shard_map's type check refuses: pass `backend=pmap`, "
                "or start the carry from the inputs (e.g. jnp.zeros_like of a row's slice)"
            ) from None

    return checked


def preflight(forward: Callable, params, model_state, batch: dict, axis,
              options: StepOptions, traced: ClosedJaxpr | None = None) -> dict[int, str]:
    """The refusals (`dpax.analysis.refusals`), from one trace of `forward`
    on one device's first micro-batch: raises what N devices would train
    differently from one device, and returns {leaf index: path} of the model
    state to average (`_average_state`). `traced`: the gradient's trace of
    that micro-batch (`_sums_and_grads`), whose forward part is read instead
    of tracing `forward` again, unless it holds derivative forms the
    analysis cannot read (`dpax.analysis.refusals.refuse`; a model's own
    random streams are judged on traces of `forward` at two batch sizes).

    Called as the step is traced: one device's shapes and the number of
    devices exist only once a backend (`pmap`, `shard_map`) traces the
    per-device function. It reads shapes only and adds nothing to the
    step's program."""
    n_micro = options.grad_accum
    micro = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct((v.shape[0] // n_micro,) + v.shape[1:], v.dtype), batch)
    asks = Asks(own_random=options.own_random, average_state=options.average_state,
                sync_batchnorm=options.sync_batchnorm)
    names, sizes = _axis_sizes(axis)
    jaxpr = None
    # Effects (a callback, a write to a ref) are not outputs: only the
    # forward's own trace is sure to hold them.
    if traced is not None and not options.own_random and not traced.jaxpr.effects:
        jaxpr = ClosedJaxpr(_value_part(traced.jaxpr, len(jax.tree.leaves(params))),
                            traced.consts)
    return refuse(forward, (params, model_state, micro), names, sizes, asks, jaxpr=jaxpr)


def _axis_sizes(axis) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh axes of the devices and the devices along each, as a
    backend's per-device function sees them."""
    names = axis if isinstance(axis, tuple) else (axis,)
    return names, tuple(jax.lax.axis_size(a) for a in names)


def _value_part(jaxpr: Jaxpr, n_grads: int) -> Jaxpr:
    """A traced `value_and_grad` of `forward` without its gradients: the
    forward's outputs. Its inputs are `forward`'s, in order; the backward
    pass's equations, which these outputs do not need, the analyses leave
    out (`dpax.analysis.live`)."""
    return jaxpr.replace(outvars=jaxpr.outvars[:len(jaxpr.outvars) - n_grads])


def _step_key(state: TrainState):
    return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def _forward(graphdef: nnx.GraphDef, loss_fn: LossFn, use: Callable, key, axis,
             options: StepOptions) -> Callable:
    """`forward(params, model_state, micro) -> (loss_sum, (count, sums,
    new_state))`: one micro-batch's masked sums, the model in train mode."""

    def forward(params, model_state, micro):
        # Fresh Variable objects at this trace level: NNX refuses to update
        # (e.g. BatchNorm's running averages) Variables from an outer trace.
        fresh = jax.tree.map(lambda a: a, model_state)
        model = model_in(graphdef, use(params), fresh, options.compute_dtype)
        model.train()  # batch statistics and dropout on
        micro_in = _cast_inputs(micro, options.compute_dtype)
        with batch_context(_context(micro_in, key, axis, options)):
            loss_sum, count, sums = shard_sums(loss_fn, model, micro_in)
        nnx.pop(model, SOWN)  # read by the loss, if at all; not carried
        _, _, new_state = nnx.split(model, nnx.Param, ...)
        _refuse_new_state(new_state, model_state)
        # Model state keeps its own dtype whatever the compute dtype was.
        new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, model_state)
        return loss_sum, (count, sums, new_state)

    return forward


def _refuse_new_state(new_state, model_state) -> None:
    """A step carries the model state the model held when the Trainer was
    made: refuse a forward that makes Variables of its own (a layer that
    creates its state on its first call) or drops some."""
    if jax.tree.structure(new_state) == jax.tree.structure(model_state):
        return

    def paths(state):
        return {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}

    made, dropped = paths(new_state) - paths(model_state), paths(model_state) - paths(new_state)
    which = ([f"made: {p}" for p in sorted(made)[:3]]
             + [f"dropped: {p}" for p in sorted(dropped)[:3]])
    raise DpaxError(
        f"the model's forward changes which Variables it holds ({', '.join(which)}): dpax "
        "trains the state a model holds when the Trainer is made; create every Variable in "
        "__init__ (what Module.sow stores is dropped after the loss has run)")


def _sums_and_grads(forward: Callable, wrt, reorder: ReduceBeforeTranspose | None,
                    options: StepOptions, traced: list) -> Callable:
    """`(model_state, micro) -> ((loss_sum, count, sums, grads), model_state)`:
    one micro-batch's sums and this device's gradient sums by `wrt`. The
    first call's trace of the gradient is appended to `traced`."""

    def sums_and_grads(model_state, micro):
        grad_fn = jax.value_and_grad(forward, has_aux=True)
        if options.backward is not None:  # the XLA:CPU tuning's forms, from its own trace
            out = options.backward(lambda p: grad_fn(p, model_state, micro))(wrt)
        else:
            # Traced once: what the preflight reads, and the program the step runs.
            closed, shape = jax.make_jaxpr(grad_fn, return_shape=True)(wrt, model_state, micro)
            if not traced:
                traced.append(closed)
            if reorder is not None:
                out = reorder.call(closed, shape, wrt, model_state, micro)
            else:
                out = jax.tree.unflatten(jax.tree.structure(shape), jaxpr_as_fun(closed)(
                    *jax.tree.leaves((wrt, model_state, micro))))
        (loss_sum, (count, sums, model_state)), grads = out
        return (loss_sum, count, sums, grads), model_state

    return sums_and_grads


def _accumulate(sums_and_grads: Callable, model_state, batch: dict, n_micro: int):
    """The shard's sums and gradient sums over its `n_micro` micro-batches,
    and the model state after the last: `((loss_sum, count, sums, grads),
    model_state)`."""
    if n_micro == 1:
        return sums_and_grads(model_state, batch)
    # The shard's micro-batches, summed in a scan: activations of one
    # micro-batch live at a time, and the all-reduce after it still runs once.
    # Strided, not contiguous: a shard holds a multiple of n_micro rows,
    # so micro-batch j holds the global rows r with r % n_micro == j on
    # every device count. What a micro-batch computes together (a
    # BatchNorm's statistics) then covers the same examples as on one
    # device; contiguous runs of each shard would not.
    micro = jax.tree.map(lambda v: v.reshape((-1, n_micro) + v.shape[1:]).swapaxes(0, 1), batch)
    first = jax.tree.map(lambda v: v[0], micro)
    acc, model_state = sums_and_grads(model_state, first)

    def add(carry, mb):
        acc, model_state = carry
        new, model_state = sums_and_grads(model_state, mb)
        return (jax.tree.map(jnp.add, acc, new), model_state), None

    (acc, model_state), _ = jax.lax.scan(
        add, (acc, model_state), jax.tree.map(lambda v: v[1:], micro))
    return acc, model_state


def _average_state(model_state, per_device: dict[int, str], axis, pack: bool):
    """State of a layer dpax does not synchronize (e.g. a custom running
    mean): what a device computes from its own rows (`per_device`, only
    with sync_batchnorm off) is averaged; what it computes from what every
    device holds alike needs no average."""
    leaves, treedef = jax.tree.flatten(model_state)
    for i, mean in zip(per_device, pmean_tree([leaves[i] for i in per_device], axis, pack)):
        leaves[i] = mean
    # The same value everywhere, but typed per device where it came from
    # the params as differentiated: a max of equal values types it as
    # replicated and keeps its bits (a mean over 3 would not).
    typed = [i for i, leaf in enumerate(leaves) if i not in per_device
             and numeric(leaf) and typed_varying(leaf, axis)]
    if typed:
        for i, same in zip(typed, jax.lax.pmax([leaves[i] for i in typed], axis)):
            leaves[i] = same
    return jax.tree.unflatten(treedef, leaves)


def _reduce(layout: Layout, reorder: ReduceBeforeTranspose | None, options: StepOptions,
            acc: tuple, model_state) -> Reduced:
    """The device's sums, all-reduced as the layout does (its gradients in
    the all-reduce dtype), and untransposed where the sums were not."""
    loss_sum, count, sums, grad_sums = acc
    if not layout.grads_in_backward:
        grad_sums = cast_floats(grad_sums, options.allreduce_dtype)
    loss_sum, count, sums, grads = layout.reduce(loss_sum, count, sums, grad_sums)
    for_norm = None
    if reorder is not None:
        # A sharded layout's norm runs under jit, on the logical gradient.
        if layout.per_device_update:
            for_norm = reorder.for_norm(grads)
        grads = reorder.transposes(grads)
    return Reduced(loss_sum, count, sums, grads, model_state, for_norm)


def _carry_types_differ(e: TypeError) -> bool:
    """Is `e` shard_map's type check refusing a loop's carry that starts alike
    on every device (zeros) and comes back computed from the device's rows?
    JAX 0.10 raises a plain TypeError for it, whose text ends "so the manual
    axis types do not match" (`jax._src.core.aval_mismatch_extra`): the text
    is all there is to tell it by."""
    return "manual axis types do not match" in str(e)


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
    update = make_update(tx, schedule, UpdateOptions(
        skip_nonfinite=options.skip_nonfinite, clip_norm=options.clip_norm,
        ema_decay=options.ema_decay, whole_leaves=layout.per_device_update))
    # The step is a jit of its own, which XLA inlines: a Trainer traces its
    # step twice (once for the metrics' shapes, once to compile it), and
    # jit's trace cache turns the second trace into a lookup.
    if layout.per_device_update:
        return jax.jit(lambda state, batch: update(state, grad_step(state, batch)))

    # The gradient part reads neither the optimizer state nor the EMA.
    def inputs(tree):
        return tree.replace(opt_state=None, ema=None)

    rows, whole = P(layout.axis), P()
    grads_of = per_device(
        grad_step, (inputs(layouts.specs(layout)), rows),
        Reduced(whole, whole, whole, jax.tree.map(lambda s: s.spec, layout.grad_splits), whole))

    @jax.jit
    def train_step(state: TrainState, batch: dict):
        r = grads_of(inputs(state), batch)
        r = r.replace(grads=jax.tree.map(lambda s, g: s.unpad(g), layout.grad_splits, r.grads))
        new, metrics = update(layouts.logical(layout, state), r)
        return layouts.stored(layout, new), metrics

    return train_step


def make_multi_step(step: Callable, unroll: bool = False) -> Callable:
    """Several steps in one call: a scan of `step(state, acc, batch) -> (state,
    acc)` over batches stacked along a leading axis. For dispatch-bound models:
    one launch instead of one per step. `unroll` (the XLA:CPU tuning's: inside
    an XLA:CPU loop a conv loses its thread pool) compiles longer.
    """

    def multi_step(state: TrainState, acc, batches: dict):
        def body(carry, batch):
            return step(*carry, batch), None

        (state, acc), _ = jax.lax.scan(body, (state, acc), batches, unroll=unroll)
        return state, acc

    return multi_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn, layout: Layout,
                   options: StepOptions = StepOptions()):
    """The per-device eval step: `(state, shard) -> metrics` of the global
    batch, with `eval_params`."""

    def forward(params, model_state, batch: dict):
        model = nnx.merge(graphdef, params, model_state)
        model.eval()  # running averages, no dropout
        with batch_context(_context(batch, None, layout.axis, options)):
            return shard_sums(loss_fn, model, batch, differentiated=False)

    def eval_step(state: TrainState, batch: dict):
        args = (layout.full_params(eval_params(state)), state.model_state,
                _with_index(batch, layout.axis))
        loss_sum, count, sums = _refused_or_run(forward, args, layout.axis, options)
        return example_metrics(*psum_tree((loss_sum, count, sums), layout.axis, options.pack))

    return eval_step


def _refused_or_run(forward: Callable, args: tuple, axis, options: StepOptions):
    """`forward(params, model_state, rows)` in the trace of an evaluation or
    prediction step, after the refusals of what N devices would compute
    differently from one (`refuse`: examples mixed, the number of rows read),
    read from its own trace, which the step then runs."""
    closed, shape = jax.make_jaxpr(forward, return_shape=True)(*args)
    names, sizes = _axis_sizes(axis)
    refuse(forward, args, names, sizes, Asks(sync_batchnorm=options.sync_batchnorm),
           jaxpr=closed)
    return jax.tree.unflatten(jax.tree.structure(shape),
                              jaxpr_as_fun(closed)(*jax.tree.leaves(args)))


def make_predict_step(graphdef: nnx.GraphDef, predict_fn: Callable, layout: Layout,
                      options: StepOptions = StepOptions()):
    """The per-device predict step: one output per example of the shard, with
    `eval_params`."""

    def forward(params, model_state, batch: dict):
        model = nnx.merge(graphdef, params, model_state)
        model.eval()
        return predict_fn(model, batch)

    def predict_step(state: TrainState, batch: dict):
        args = (layout.full_params(eval_params(state)), state.model_state, batch)
        return _refused_or_run(forward, args, layout.axis, options)

    return predict_step
