"""Pure functions that move between a global batch and a leading device axis.

A global batch of any size B >= 1 is padded to a multiple of the device count and
carries a boolean mask; every consumer divides by the mask's count, so padding
never counts and no example is dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

Batch = dict[str, Any]  # arrays (or nested dicts of them) sharing a leading example axis
MASK = "mask"  # the boolean real-row entry dpax adds to every batch
INDEX = "index"  # each row's position in the global batch, added inside the step


def padded_size(batch_size: int, n: int) -> int:
    """The smallest multiple of `n` that holds `batch_size` examples."""
    return -(-batch_size // n) * n


def batch_rows(batch: Any) -> int:
    """The examples in a batch: the common length of its arrays' leading axes."""
    sizes = {jax.tree_util.keystr(p): len(v)
             for p, v in jax.tree_util.tree_flatten_with_path(batch)[0]}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch arrays differ in length: {sizes}")
    return next(iter(sizes.values()), 0)


def pad_batch(batch: Batch, size: int) -> Batch:
    """Zero-pad every array of `batch` (a dict of arrays, possibly nested) to
    `size` rows and add the `mask` entry.

    Zeros keep every loss finite on the padded rows; the mask keeps them out of
    every sum.
    """
    old = batch.get(MASK)
    b = batch_rows(batch)
    if not 0 <= b <= size:  # 0: a process whose rows of the batch are all padding
        raise ValueError(f"batch of {b} examples does not fit a padded size of {size}")

    def pad(v):
        v = np.asarray(v)
        if size > b:
            v = np.concatenate([v, np.zeros((size - b,) + v.shape[1:], v.dtype)])
        return v

    out = {k: jax.tree.map(pad, v) for k, v in batch.items()}
    mask = np.zeros(size, bool)
    mask[:b] = True if old is None else np.asarray(old, bool)
    out[MASK] = mask
    return out


def shard_batch(batch: Batch, n: int, size: int | None = None) -> Batch:
    """Pad a global batch to `size` rows (default: next multiple of `n`) and
    reshape every array to `(n, size // n, ...)`, with a boolean `mask`."""
    b = batch_rows(batch)
    size = padded_size(b, n) if size is None else size
    if size % n:
        raise ValueError(f"padded size {size} is not a multiple of {n} devices")
    padded = pad_batch(batch, size)
    return jax.tree.map(lambda v: v.reshape((n, size // n) + v.shape[1:]), padded)


def unshard(tree: Any, mask: np.ndarray | None = None) -> Any:
    """Merge the leading device axis back into the batch axis; with `mask`
    (as `shard_batch` made it) keep only the real examples, in order."""
    flat = jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + np.shape(x)[2:]), tree)
    if mask is None:
        return flat
    keep = np.asarray(mask).reshape(-1)
    return jax.tree.map(lambda x: x[keep], flat)


def replicate(tree: Any, n: int) -> Any:
    """Stack `n` copies of every leaf along a new leading axis (pmap layout), on
    the host. `jax.pmap(f, in_axes=None)` with nothing mapped fails on current
    JAX; this is what the seeds' broadcast trick meant."""
    def stack(x):
        if is_key(x):  # typed PRNG keys: stack their data, then wrap it again
            data = np.asarray(jax.random.key_data(x))
            return jax.random.wrap_key_data(np.broadcast_to(data, (n,) + data.shape),
                                            impl=jax.random.key_impl(x))
        return np.broadcast_to(np.asarray(x), (n,) + np.shape(x))

    return jax.tree.map(stack, tree)


def is_key(x: Any) -> bool:
    """A typed PRNG key array (numpy cannot hold these)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def host_leaf(x: Any) -> Any:
    """This process's first-device copy of a replicated array, on the host; a
    typed PRNG key stays a key (rebuilt from its data)."""
    local = x.addressable_data(0) if isinstance(x, jax.Array) else x
    if is_key(local):
        return jax.random.wrap_key_data(np.asarray(jax.random.key_data(local)),
                                        impl=jax.random.key_impl(local))
    return np.asarray(local)


def _first(x: Any) -> Any:
    # The local copy on this process's first device; `x[0]` on a global array
    # would gather across hosts.
    return host_leaf(x)[0]


def unreplicate(tree: Any) -> Any:
    """One host copy of a tree stacked along a leading replica axis."""
    return jax.tree.map(_first, tree)


def _replica_bytes(x: Any) -> list[bytes]:
    if is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array):
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        if x.is_fully_replicated:
            return [s.tobytes() for s in shards]
        # pmap layout: each shard is one replica's (1, ...) slice.
        return [r.tobytes() for s in shards for r in s]
    return [r.tobytes() for r in np.asarray(x)]


def replicas_in_sync(tree: Any) -> bool:
    """True when every local replica of every leaf is bit-identical.

    Works on both layouts: replicated `jax.Array`s (shard_map) and arrays
    stacked along a leading replica axis (pmap, or host numpy).
    """
    for leaf in jax.tree.leaves(tree):
        copies = _replica_bytes(leaf)
        if any(c != copies[0] for c in copies[1:]):
            return False
    return True
