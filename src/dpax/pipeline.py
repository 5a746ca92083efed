"""Host input pipeline on Grain: which examples form the batch of each step.

Batch `s` depends only on the seed and `s`, never on the device count: epoch
`e = s // steps_per_epoch` is a fresh Grain shuffle of all examples (Grain
reshuffles every pass over the data), cut into batches of the global batch
size; the last batch of an epoch is short and gets padded, never dropped.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from dpax.sharding import Batch, pad_batch


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Epoch-aligned global batches over `n_examples`, in a seeded order."""

    n_examples: int
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.n_examples // self.batch_size)

    def indices(self, step: int) -> np.ndarray:
        """Example indices of global batch `step`, in order."""
        epoch, j = divmod(step, self.steps_per_epoch)
        order = _shuffled(self.n_examples, self.seed)
        lo = epoch * self.n_examples + j * self.batch_size
        hi = epoch * self.n_examples + min((j + 1) * self.batch_size, self.n_examples)
        return np.fromiter((order[i] for i in range(lo, hi)), np.int64, hi - lo)


def _shuffled(n: int, seed: int) -> grain.MapDataset:
    # Index i of the repeated dataset is epoch i // n; Grain draws a new
    # permutation per epoch from the seed, so epochs differ but are reproducible.
    return grain.MapDataset.range(n).shuffle(seed=seed).repeat()


def local_part(x: np.ndarray, y: np.ndarray, idx: np.ndarray, rows: tuple[int, int]) -> Batch:
    """Rows [lo, hi) of the padded global batch whose examples are `idx`: only
    this process's examples are read; positions past len(idx) are padding."""
    lo, hi = rows
    mine = idx[lo:hi]
    return pad_batch({"x": x[mine], "y": y[mine]}, hi - lo)


def train_batches(
    x: np.ndarray, y: np.ndarray, plan: BatchPlan, rows: tuple[int, int], start: int, stop: int
) -> grain.IterDataset:
    """This process's rows of the padded, masked global batches of steps
    `start..stop-1`. One Grain worker thread builds batch i+1 while the device
    runs step i.
    """
    def make(step: int) -> Batch:
        return local_part(x, y, plan.indices(step), rows)

    ds = grain.MapDataset.range(start, stop).map(make)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))


def eval_batches(x: np.ndarray, y: np.ndarray, batch_size: int, rows: tuple[int, int]):
    """This process's rows of sequential padded, masked global batches that
    cover every example exactly once."""
    for start in range(0, len(x), batch_size):
        idx = np.arange(start, min(start + batch_size, len(x)))
        yield local_part(x, y, idx, rows)
