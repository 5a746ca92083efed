"""Sums over the devices of a mesh axis: in one fixed order, and packed on
XLA:CPU.

Packing (with the XLA:CPU tuning, `dpax.parallel.platform`): `jax.lax.psum`
of a pytree lowers to one all-reduce with one operand per leaf, and XLA:CPU's
in-process collectives meet at a rendezvous once per operand. Packing the
small leaves into one flat buffer per dtype makes it one rendezvous. GPU and
TPU compilers combine small all-reduces themselves, so elsewhere the tree
goes to `psum` as it is. Either way every element's sum is the same.

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

from dpax.data.batches import padded_size

# Leaves this large go as their own operand: copying them into a packed buffer
# costs more than their rendezvous saves.
PACK_MAX = 1 << 16

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
    chunk = padded_size(size, n) // n
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
    """`jax.lax.psum(tree, axis)` (in rank order across processes on CPU);
    `pack`: the small leaves sent as one flat buffer per dtype, large leaves
    as they are."""
    if jax.lax.axis_size(axis) == 1:  # nothing to add up (the backends run one
        return tree                     # device without the replication check)
    leaves, treedef = jax.tree.flatten(tree)
    if not pack:
        return jax.tree.unflatten(treedef, _sum(leaves, axis))
    groups: dict[Any, list[int]] = {}
    large = []
    for i, leaf in enumerate(leaves):
        if np.size(leaf) > PACK_MAX:
            large.append(i)
        else:
            groups.setdefault(jnp.result_type(leaf), []).append(i)
    # The barrier keeps XLA from fusing the producers (dots) into the
    # concatenation, where they would lose their matmul kernels.
    order = [i for idx in groups.values() for i in idx]
    small = dict(zip(order, jax.lax.optimization_barrier([leaves[i] for i in order])))
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


def synced_sum(tree: Any, axis: str, pack: bool = False) -> tuple[Any, Any]:
    """`psum_tree` for values a model differentiates through (SyncBatchNorm's
    statistics), whose backward pass sums the cotangents with `psum_tree` too.

    Returns the sums twice, from one all-reduce: typed as replicated (for what
    the step returns, e.g. running averages) and typed per device ("varying",
    for the math that is differentiated). On the second, JAX adds no all-reduce
    of its own where it meets per-device values, so the backward pass has one
    sum, in the same order whatever the processes.
    """
    if jax.lax.axis_size(axis) == 1:
        return tree, tree
    return _synced(tree, axis, pack)


def _varying(tree: Any, axis: str) -> Any:
    return jax.tree.map(lambda x: jax.lax.pcast(x, axis, to="varying"), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _synced(tree: Any, axis: str, pack: bool) -> tuple[Any, Any]:
    total = psum_tree(tree, axis, pack)
    return total, _varying(total, axis)


def _synced_fwd(tree, axis, pack):
    return _synced(tree, axis, pack), None


def _synced_bwd(axis, pack, _, cotangents):
    # d(sum_e x_e)/dx_d = 1 on every device d: each input gets every device's
    # cotangent. A replicated output's cotangent is already that total.
    replicated, per_device = cotangents
    total = jax.tree.map(jnp.add, replicated, psum_tree(per_device, axis, pack))
    return (_varying(total, axis),)


_synced.defvjp(_synced_fwd, _synced_bwd)
