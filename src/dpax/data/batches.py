"""A global batch as every step sees it: padded to a size the devices split,
with a boolean mask of its real rows.

A global batch of any size B >= 1 is padded to a multiple of the device count;
every consumer divides by the mask's count, so padding never counts and no
example is dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Batch = dict[str, Any]  # arrays (or nested dicts of them) sharing a leading example axis
MASK = "mask"  # the boolean real-row entry dpax adds to every batch
INDEX = "index"  # each row's position in the global batch, added inside the step
ROWS = "rows"  # the example indices of a batch gathered on the device (`gather_rows`)


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


def gather_rows(data: Batch, rows: Batch) -> Batch:
    """On the device: the batch of the examples `rows[ROWS]` of `data` (arrays
    placed on every device), its padded rows zero as `pad_batch` makes them,
    with `rows`'s mask; `rows` may stack several steps' batches (leading
    axes). The same batch as the host pipeline's, without a host-to-device
    copy of its examples each step."""
    mask = rows[MASK]

    def take(a):
        keep = mask.reshape(mask.shape + (1,) * (a.ndim - 1))
        return jnp.where(keep, a[rows[ROWS]], jnp.zeros((), a.dtype))

    return {**jax.tree.map(take, data), MASK: mask}
