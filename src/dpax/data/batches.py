"""A global batch as every step sees it: padded to a size the devices split,
with a boolean mask of its real rows.

A global batch of any size B >= 1 is padded to a multiple of the device count;
every consumer divides by the mask's count, so padding never counts and no
example is dropped. The padded rows are copies of a real example, not
zeros: the mask keeps them out of every sum, but the model and the loss
still run on them, and a row of zeros can make them divide by zero (an
input's norm, a count the loss weighs by), whose gradient is NaN even
where the mask leaves the row out. A copy of a real example computes
whatever the real one does, so padding is as finite as the data.
"""

from __future__ import annotations

from typing import Any

import jax
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


def pad_batch(batch: Batch, size: int, fill: Batch | None = None) -> Batch:
    """Pad every array of `batch` (a dict of arrays, possibly nested) to
    `size` rows and add the `mask` entry.

    The padded rows are copies of `fill` (a batch of one example, without a
    mask), else of the batch's first real row, else of its first row (see
    the module's docstring); a batch of no rows and no `fill` is padded with
    zeros. The mask keeps them out of every sum.
    """
    old = batch.get(MASK)
    b = batch_rows(batch)
    if not 0 <= b <= size:  # 0: a process whose rows of the batch are all padding
        raise ValueError(f"batch of {b} examples does not fit a padded size of {size}")
    if fill is not None and (set(fill) != set(batch) - {MASK} or batch_rows(fill) != 1):
        raise ValueError(f"`fill` must be one example of the batch's arrays, got "
                         f"{batch_rows(fill)} of {sorted(fill)}")
    if fill is None and 0 < b < size:
        real = np.flatnonzero(np.asarray(old, bool)) if old is not None else [0]
        first = real[0] if len(real) else 0  # no real row: still the user's own data
        fill = {k: jax.tree.map(lambda a: np.asarray(a)[first:first + 1], v)
                for k, v in batch.items() if k != MASK}

    def pad(v, row=None):
        v = np.asarray(v)
        if size > b:
            row = np.zeros((1,) + v.shape[1:], v.dtype) if row is None else np.asarray(row)
            v = np.concatenate([v, np.repeat(row.astype(v.dtype), size - b, axis=0)])
        return v

    out = {k: jax.tree.map(pad, v) if fill is None else jax.tree.map(pad, v, fill[k])
           for k, v in batch.items() if k != MASK}
    mask = np.zeros(size, bool)
    mask[:b] = True if old is None else np.asarray(old, bool)
    out[MASK] = mask
    return out


def gather_rows(data: Batch, rows: Batch) -> Batch:
    """On the device: the batch of the examples `rows[ROWS]` of `data` (arrays
    placed on every device), with `rows`'s mask; `rows` may stack several
    steps' batches (leading axes). Its padded rows hold the example
    `pad_batch` copied into them (`local_part` pads the indices with the
    same example as the examples), so this is the host pipeline's batch,
    without a host-to-device copy of its examples each step."""
    return {**jax.tree.map(lambda a: a[rows[ROWS]], data), MASK: rows[MASK]}
