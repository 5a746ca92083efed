"""Layers whose result must not depend on the device count, made exact.

Plain data parallelism changes what two common layers compute: BatchNorm
normalizes with per-device statistics (padded rows included), and Dropout draws
its masks from a per-device key. dpax converts a user's `nnx.BatchNorm` and
`nnx.Dropout` in place (`synchronize`), the way PyTorch's SyncBatchNorm
conversion does but automatically:

- `SyncBatchNorm`: statistics over the GLOBAL batch, across devices and
  processes, weighted by the mask, so padded rows never count; the running
  averages then update identically on every replica.
- `ExampleDropout`: each example's mask comes from a key derived from the run's
  seed, the step and the example's index in the global batch, so it is the same
  whatever N is and wherever the example lands.

Both read the batch context (`mask`, example indices, key) that dpax's step sets
while it traces the model; outside a dpax step they behave as their parents.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import export

from dpax.collectives import exact_sums


@dataclasses.dataclass
class BatchContext:
    mask: jax.Array  # (b,) real rows of this device's (micro-)batch
    index: jax.Array  # (b,) each row's position in the global batch
    key: jax.Array | None  # typed PRNG key for this step
    axis: str | None  # the device axis, or None on one device / outside dpax
    sync_batchnorm: bool = True  # Linen's nn.BatchNorm: global statistics (`dpax.models.bridge`)
    pack: bool = False  # all-reduce operands packed (`dpax.collectives`)
    calls: int = 0  # dropout layers called so far: each gets its own stream


_CONTEXT: contextvars.ContextVar[BatchContext | None] = contextvars.ContextVar(
    "dpax_batch", default=None)


@contextlib.contextmanager
def batch_context(ctx: BatchContext):
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def current() -> BatchContext | None:
    """The batch context of the dpax step being traced, or None outside one."""
    return _CONTEXT.get()


def global_moments(x: jax.Array, feature_axes: tuple[int, ...], ctx: BatchContext,
                   mask: jax.Array | None = None):
    """Mean and (biased) variance over every axis but `feature_axes`, over the
    real rows of the GLOBAL batch. Returns them twice: per device (to
    normalize with: differentiated) and replicated (for running averages:
    state the step returns). `mask` (a BatchNorm's own: boolean,
    broadcastable to `x`): only its True positions of the real rows count,
    each feature over its own count.

    The sums are exact sums (`dpax.collectives.exact_sums`): the
    statistics have the same bits on one device and on N, so the layer's
    output does too, and a max pool after it breaks its ties alike."""
    rows = ctx.mask.reshape((-1,) + (1,) * (x.ndim - 1)).astype(jnp.float32)
    xf = x.astype(jnp.float32)
    per_row = x.size // (x.shape[0] * math.prod(x.shape[a] for a in feature_axes))
    # Summed axes first, flattened: the rows the exact sums add along axis 0.
    # (Each example's own sums first would be cheaper, but XLA reduces an
    # example's values in another order in a batch of another size.)
    features = tuple(x.shape[a] for a in feature_axes)

    def flat(v):
        return jnp.moveaxis(v, feature_axes, range(-len(features), 0)).reshape((-1,) + features)

    if mask is None:
        weight, count = rows, rows.reshape(-1) * per_row
    else:
        weight = jnp.broadcast_to(rows * jnp.asarray(mask, jnp.float32), x.shape)
        count = flat(weight)
    values = (flat(xf * weight), flat(jnp.square(xf) * weight), count)
    if ctx.axis is None:
        replicated = per_device = tuple(jnp.sum(v, 0) for v in values)
    else:
        most = x.shape[0] * per_row * jax.lax.axis_size(ctx.axis)  # every row real
        replicated, per_device = _global_sums(values, ctx.axis, most)
    return _moments(*per_device), jax.lax.stop_gradient(_moments(*replicated))


# Below this, a float32 sum of whole numbers is exact in any order.
EXACT_INTEGERS = 2**24


def _global_sums(values: tuple, axis: str, most: int) -> tuple[tuple, tuple]:
    """`exact_sums(values, axis)` for (sum, sum of squares, count), with the
    same bits and a smaller program: each level of an exact sum is a fusion
    of its own for XLA to compile, so three sums apart multiply a BatchNorm
    model's compile time. The two sums share one exact sum,
    stacked (each column is still summed alone, by the same operations), and
    the count, whole numbers, is a plain sum when its total (`most` at the
    largest) stays below `EXACT_INTEGERS`."""
    s1, s2, count = values
    # A symbolic batch (`dpax.analysis.batch_size`'s trace) has no size to
    # compare: that trace is read, not run, and the exact count serves any.
    if export.is_symbolic_dim(most) or most >= EXACT_INTEGERS:
        return exact_sums(values, axis)
    (both,), (both_per_device,) = exact_sums((jnp.stack([s1, s2], 1),), axis)
    total = jax.lax.psum(jnp.sum(count, 0), axis)  # per feature where a mask counts
    return (both[0], both[1], total), (both_per_device[0], both_per_device[1], total)


class SyncBatchNorm(nnx.BatchNorm):
    """`nnx.BatchNorm` with masked statistics over the global batch (per layer
    and step, one exact all-reduce of the sums and squared sums, and one psum
    of the count); a `mask` given to the call counts as nnx.BatchNorm counts
    it, on top of the batch's real rows."""

    def __call__(self, x, use_running_average=None, *, mask=None):
        ctx = current()
        use_ra = self.use_running_average if use_running_average is None else use_running_average
        if ctx is None or use_ra:
            return super().__call__(x, use_running_average, mask=mask)
        feature = self.axis % x.ndim
        (mean, var), (running_mean, running_var) = global_moments(x, (feature,), ctx, mask)
        self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * running_mean
        self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * running_var
        shape = [1] * x.ndim
        shape[feature] = x.shape[feature]
        y = (x.astype(jnp.float32) - mean.reshape(shape)) * jax.lax.rsqrt(
            var.reshape(shape) + self.epsilon)
        if self.scale is not None:
            y = y * self.scale[...].reshape(shape)
        if self.bias is not None:
            y = y + self.bias[...].reshape(shape)
        return y.astype(self.dtype or x.dtype)


def _moments(s1, s2, count):
    """Mean and (biased) variance from sums over `count` values."""
    # One reciprocal, multiplied: XLA turns a division by a broadcast scalar
    # into a multiplication by its reciprocal in some programs and not in
    # others, and the two round differently.
    inv = 1.0 / jnp.maximum(count, 1.0)
    mean = s1 * inv
    return mean, jnp.maximum(0.0, s2 * inv - jnp.square(mean))


def example_dropout(inputs: jax.Array, rate: float, broadcast_dims=(),
                    ctx: BatchContext | None = None) -> jax.Array:
    """Dropout whose mask for an example depends on (seed, step, the example's
    global index, which dropout call) and nothing else; `inputs` unchanged
    outside a dpax training step (evaluation, prediction, plain calls).

    For models written as plain functions; `nnx.Dropout` and Linen's
    `nn.Dropout` get this mask by themselves.
    """
    ctx = current() if ctx is None else ctx
    if ctx is None or ctx.key is None or rate == 0.0:
        return inputs
    if rate == 1.0:
        return jnp.zeros_like(inputs)
    layer_key = jax.random.fold_in(ctx.key, ctx.calls)
    ctx.calls += 1
    shape = list(inputs.shape[1:])
    for d in broadcast_dims:
        if d > 0:
            shape[d - 1] = 1

    def keep(i):
        return jax.random.bernoulli(jax.random.fold_in(layer_key, i), 1.0 - rate, tuple(shape))

    mask = jax.vmap(keep)(ctx.index)
    return jnp.where(mask, inputs / (1.0 - rate), jnp.zeros_like(inputs))


def global_rows(x: jax.Array, ctx: BatchContext | None = None) -> tuple[jax.Array, jax.Array]:
    """`x` (one value per row of this device's batch) for every row of the
    global batch, in its order, and the mask of those rows: what a loss over
    the whole batch (a contrastive loss's other examples) needs to compute on
    N devices what it computes on one. Row i of this device is row
    `batch["index"][i]` of the result; padded rows are masked out. Outside a
    dpax step, or on one device, `x` and its batch's mask as they are.

    The gradient flows back to the device that holds each row (the
    all-gather's transpose), so the step stays equal to one device's."""
    ctx = current() if ctx is None else ctx
    if ctx is None:
        return x, jnp.ones(x.shape[:1], bool)
    if ctx.axis is None:
        return x, ctx.mask
    return (jax.lax.all_gather(x, ctx.axis, tiled=True),
            jax.lax.all_gather(ctx.mask, ctx.axis, tiled=True))


class ExampleDropout(nnx.Dropout):
    """`nnx.Dropout` with `example_dropout`'s masks inside a dpax step.

    "Which layer" is the order of the calls while the step is traced: a
    transform that replays one trace for several layers (`jax.checkpoint` of
    one function for every block, a scan over layers) gives them one stream;
    trace each layer (`dpax.models.gpt` makes a fresh function per block)."""

    def __call__(self, inputs, *, deterministic=None, rngs=None):
        ctx = current()
        det = self.deterministic if deterministic is None else deterministic
        if ctx is None or ctx.key is None or det or self.rate == 0.0:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        return example_dropout(inputs, self.rate, self.broadcast_dims, ctx)


def synchronize(model: nnx.Module, batchnorm: bool = True, dropout: bool = True) -> dict:
    """Convert the model's `nnx.BatchNorm` / `nnx.Dropout` layers in place to
    their N-independent versions; returns how many of each were converted."""
    counts = {"batchnorm": 0, "dropout": 0}
    for _, module in nnx.iter_modules(model):
        if batchnorm and type(module) is nnx.BatchNorm:
            module.__class__ = SyncBatchNorm
            counts["batchnorm"] += 1
        elif dropout and type(module) is nnx.Dropout:
            module.__class__ = ExampleDropout
            counts["dropout"] += 1
    return counts


def draws_own_random(model: nnx.Module) -> bool:
    """True when the model holds RNG streams outside dpax's dropout layers:
    it may draw from a key that every device holds alike."""
    dropouts = [tuple(path) for path, m in nnx.iter_modules(model)
                if isinstance(m, ExampleDropout)]
    _, _, rest = nnx.split(model, nnx.Param, ...)
    return any(isinstance(var, nnx.RngState)
               and not any(tuple(path[:len(d)]) == d for d in dropouts)
               for path, var in nnx.to_flat_state(rest))


def has_per_device_state(model: nnx.Module) -> bool:
    """True when the model holds numeric state (not params, not RNG streams)
    that no synchronized layer owns, e.g. a BatchNorm subclass, a custom
    running mean or counter, a constant buffer: the step then reads which of
    it differs per device (`dpax.training.step`)."""
    synced = {tuple(path) for path, m in nnx.iter_modules(model)
              if isinstance(m, SyncBatchNorm)}
    _, _, rest = nnx.split(model, nnx.Param, ...)
    for path, var in nnx.to_flat_state(rest):
        if isinstance(var, nnx.RngState):  # advanced alike on every device
            continue
        value = var[...] if isinstance(var, nnx.Variable) else var
        numeric = jnp.issubdtype(getattr(value, "dtype", jnp.bool_), jnp.number)
        if numeric and tuple(path[:-1]) not in synced:
            return True
    return False
