"""Sums over the devices of a mesh axis: in one fixed order, and packed on
XLA:CPU.

Packing: `jax.lax.psum` of a pytree lowers to one all-reduce with one operand
per leaf, and XLA:CPU's in-process collectives meet at a rendezvous once per
operand. A step's scalar sums (loss, count, metrics) go as one buffer per
dtype everywhere (a few floats copied). With the XLA:CPU tuning
(`dpax.parallel.platform`) every small leaf is packed so, behind a barrier.
GPU and TPU compilers handle many operands well, and packing a large
gradient would cost a copy, so elsewhere the gradients go to `psum` as they
are. Either way every element's sum is the same.

Exact sums (`exact_sums`): a float sum depends on the order of its terms, and
one device adds a batch's rows in another order than N devices do. Where that
last bit would change what a model computes (a BatchNorm's statistics, which
a max pool's near-tie can turn into a different gradient), the sums are
compensated: pairwise TwoSum keeps every rounding error, the devices' partial
sums are combined in one fixed order, and the total is rounded once. That is
the correctly rounded sum but in very rare cases, so one device and N
devices get the same bits. (Summing in float64 instead did not hold in a
compiled step: XLA may sum a converted value in its original type.)

Order: a float sum depends on the order of its terms. XLA:CPU's in-process
all-reduce adds the devices' values in rank order (0 + x0 + x1 + ...); across
processes XLA:CPU uses gloo, whose ring adds them in another order. A run on 2
processes x 2 devices then differs from one process with 4 devices in the last
bit of every sum, and a model with max-pooling or ReLU can turn that bit into
a visible difference: a near-tie that flips sends a gradient elsewhere. So,
across processes on CPU, dpax adds in rank order itself (`rank_order_sum`):
every split of N devices over processes gives the bits of one process.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

# Leaves this large go as their own operand: copying them into a packed buffer
# costs more than their rendezvous saves.
PACK_MAX = 1 << 16
# Leaves this small are packed on every platform: a step's scalar sums.
SCALAR_MAX = 16

_forced: list[bool | None] = [None]  # tests: emulate the rank order in one process


@contextlib.contextmanager
def force_rank_order(on: bool = True):
    """Trace with (or without) dpax's own rank-order sums, whatever the process
    count: lets one process check the emulation against XLA's all-reduce."""
    old, _forced[0] = _forced[0], on
    try:
        yield
    finally:
        _forced[0] = old


def rank_ordered() -> bool:
    """Whether dpax adds in rank order itself: several processes on CPU (gloo)."""
    if _forced[0] is not None:
        return _forced[0]
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


def _rank_order_chunks(x: jax.Array, axis: str) -> tuple[jax.Array, int]:
    """This device's 1/n chunk of the sum over devices of flat `x` (padded to
    n chunks), added in rank order from zero as XLA:CPU's in-process
    reduce-scatter does; and the chunk length."""
    n = jax.lax.axis_size(axis)
    size = x.size
    chunk = -(-size // n)  # rounded up: n chunks hold every element
    flat = jnp.pad(x.reshape(-1), (0, chunk * n - size))
    # Row i: this device's chunk as device i holds it.
    rows = jax.lax.all_to_all(flat.reshape(n, chunk), axis, 0, 0, tiled=True)
    acc = jnp.zeros((chunk,), x.dtype)
    for i in range(n):  # explicit adds: XLA does not reorder float additions
        acc = acc + rows[i]
    return acc, chunk


def rank_order_sum(x: jax.Array, axis: str) -> jax.Array:
    """`jax.lax.psum(x, axis)` with the terms added in rank order, whatever
    the collectives library: all_to_all, the adds, then an exact gather (a psum
    in which every element has one nonzero term)."""
    n = jax.lax.axis_size(axis)
    acc, chunk = _rank_order_chunks(x, axis)
    placed = jax.lax.dynamic_update_slice(
        jnp.zeros((n * chunk,), x.dtype), acc, (jax.lax.axis_index(axis) * chunk,))
    return jax.lax.psum(placed, axis)[: x.size].reshape(x.shape)


def reduce_scatter(x: jax.Array, axis: str, dim: int = 0) -> jax.Array:
    """`jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)` of an
    `x` whose size along `dim` is a multiple of the device count, in rank
    order across processes on CPU."""
    if not rank_ordered():
        return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    # Rows of `dim` first: then each device's block of rows is one flat chunk.
    moved = jnp.moveaxis(x, dim, 0)
    rows = moved.shape[0] // jax.lax.axis_size(axis)
    chunk = _rank_order_chunks(moved, axis)[0].reshape((rows,) + moved.shape[1:])
    return jnp.moveaxis(chunk, 0, dim)


def _sum(leaves: list, axis: str) -> list:
    if rank_ordered():
        return [rank_order_sum(x, axis) if jnp.issubdtype(x.dtype, jnp.floating)
                else jax.lax.psum(x, axis) for x in leaves]  # integer sums are exact
    return jax.lax.psum(leaves, axis)


def psum_tree(tree: Any, axis: str, pack: bool = False) -> Any:
    """`jax.lax.psum(tree, axis)` (in rank order across processes on CPU), as
    one all-reduce. Its scalars (a step's loss, count and metric sums) go as
    one small buffer per dtype on every platform: a few floats copied, one
    operand instead of one each. `pack` (XLA:CPU): every small leaf packed so,
    large leaves as they are."""
    if jax.lax.axis_size(axis) == 1:  # nothing to add up (the backends run one
        return tree                     # device without the replication check)
    leaves, treedef = jax.tree.flatten(tree)
    small_max = PACK_MAX if pack else SCALAR_MAX
    groups: dict[Any, list[int]] = {}
    large = []
    for i, leaf in enumerate(leaves):
        if np.size(leaf) > small_max:
            large.append(i)
        else:
            groups.setdefault(jnp.result_type(leaf), []).append(i)
    order = [i for idx in groups.values() for i in idx]
    small = [leaves[i] for i in order]
    if pack:  # keeps XLA from fusing the producers (dots) into the concatenation,
        small = jax.lax.optimization_barrier(small)  # where they lose their kernels
    small = dict(zip(order, small))
    packed = [jnp.concatenate([jnp.ravel(small[i]) for i in idx]) for idx in groups.values()]
    summed = _sum(packed + [leaves[i] for i in large], axis)
    out = list(leaves)
    for i, leaf in zip(large, summed[len(packed):]):
        out[i] = leaf
    for buf, idx in zip(summed, groups.values()):
        sizes = [int(np.size(leaves[i])) for i in idx]
        for i, part in zip(idx, jnp.split(buf, np.cumsum(sizes)[:-1])):
            out[i] = part.reshape(jnp.shape(leaves[i]))
    return jax.tree.unflatten(treedef, out)


def pmean_tree(tree: Any, axis: str, pack: bool = False) -> Any:
    """`jax.lax.pmean(tree, axis)` (see `psum_tree`)."""
    n = jax.lax.axis_size(axis)
    return jax.tree.map(lambda s, x: (s / n).astype(jnp.result_type(x)),
                        psum_tree(tree, axis, pack), tree)


def _varying(tree: Any, axis: str) -> Any:
    return jax.tree.map(lambda x: jax.lax.pcast(x, axis, to="varying"), tree)


# -- exact sums ------------------------------------------------------------------------------
def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a + b and its rounding error, exactly: s + e == a + b (Knuth's TwoSum;
    XLA keeps IEEE semantics, it does not reassociate float additions)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


def _compensated(hi: jax.Array, lo: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) of the sum along axis 0 of the pairs (hi, lo) (lo None: zeros),
    pairwise: each level's rounding errors are kept in lo."""
    if export.is_symbolic_dim(hi.shape[0]):
        # A symbolic batch (`dpax.analysis.batch_size`'s trace, read, never
        # run) has no halving to unroll: a plain sum depends on the same values.
        return jnp.sum(hi, 0), jnp.zeros_like(hi[0]) if lo is None else jnp.sum(lo, 0)
    if lo is None:  # the first level needs no zeros
        if hi.shape[0] % 2:
            hi = jnp.pad(hi, [(0, 1)] + [(0, 0)] * (hi.ndim - 1))
        half = hi.shape[0] // 2
        hi, lo = two_sum(hi[:half], hi[half:]) if half else (hi, jnp.zeros_like(hi))
    while hi.shape[0] > 1:
        if hi.shape[0] % 2:  # a zero row is exact
            pad = [(0, 1)] + [(0, 0)] * (hi.ndim - 1)
            hi, lo = jnp.pad(hi, pad), jnp.pad(lo, pad)
        half = hi.shape[0] // 2  # contiguous halves: what vector units read best
        s, e = two_sum(hi[:half], hi[half:])
        hi, lo = s, (lo[:half] + lo[half:]) + e
    # Normalized (|lo| at most half an ulp of hi), so that adding the lo parts
    # of several such sums plainly loses nothing that matters.
    return two_sum(hi[0], lo[0])


def _exact_totals(values: tuple, axis: str) -> tuple:
    """The sums over axis 0 and over the devices, each rounded once."""
    n = jax.lax.axis_size(axis)
    return tuple(_compensated_total(v, axis, n) for v in values)


def _as_rounded(v: jax.Array) -> jax.Array:
    """`v` as float32 values: a product (x * x) fused into the additions that
    sum it becomes a fused multiply-add, rounded otherwise (or not at all), and
    two programs would sum other values. A max with the lowest float (v
    itself, but for -inf) stops that fusion."""
    return jnp.maximum(v, jnp.finfo(v.dtype).min)


def _compensated_total(v: jax.Array, axis: str, n: int) -> jax.Array:
    hi, lo = _compensated(_as_rounded(v))
    if n > 1:
        # Every device's (hi, lo) in its own row: a psum with one nonzero term
        # per element is exact, and the rows are then added in rank order.
        slot = jax.nn.one_hot(jax.lax.axis_index(axis), n, dtype=v.dtype)
        slot = slot.reshape((n,) + (1,) * hi.ndim)
        hi, lo = _compensated(jax.lax.psum(slot * hi, axis), jax.lax.psum(slot * lo, axis))
    return hi + lo


def exact_sums(values: tuple, axis: str) -> tuple[tuple, tuple]:
    """The sums along axis 0 of each array of `values` (this device's rows)
    and over the devices of `axis`, with the same bits however the rows are
    split over devices (module docstring). Returned twice, from the same
    values: typed as replicated (for what the step returns, e.g. running
    averages) and typed per device ("varying", for math that is
    differentiated: JAX then adds no all-reduce of its own where it meets
    per-device values). The backward pass is a plain sum's: every row gets
    the total's cotangent, summed over the devices."""
    return _exact(tuple(values), axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _exact(values: tuple, axis: str) -> tuple[tuple, tuple]:
    totals = _exact_totals(values, axis)
    return totals, _varying(totals, axis)


def _exact_fwd(values, axis):
    return _exact(values, axis), tuple(v.shape for v in values)


def _exact_bwd(axis, shapes, cotangents):
    # d(sum_e x_e)/dx_d = 1 on every device d: each row gets every device's
    # cotangent. A replicated output's cotangent is already that total.
    replicated, per_device = cotangents
    per_device = psum_tree(per_device, axis)  # in rank order across processes
    totals = jax.tree.map(jnp.add, replicated, per_device)
    return (tuple(_varying(jnp.broadcast_to(t, shape), axis)
                  for t, shape in zip(totals, shapes)),)


_exact.defvjp(_exact_fwd, _exact_bwd)
