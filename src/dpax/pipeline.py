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


def train_batches(
    x: np.ndarray, y: np.ndarray, plan: BatchPlan, padded_size: int, start: int, stop: int
) -> grain.IterDataset:
    """Padded, masked host batches for steps `start..stop-1`.

    One Grain worker thread builds batch i+1 while the device runs step i.
    """
    def make(step: int) -> Batch:
        idx = plan.indices(step)
        return pad_batch({"x": x[idx], "y": y[idx]}, padded_size)

    ds = grain.MapDataset.range(start, stop).map(make)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))


def eval_batches(x: np.ndarray, y: np.ndarray, batch_size: int, padded_size: int):
    """Sequential padded, masked batches covering every example exactly once."""
    for lo in range(0, len(x), batch_size):
        yield pad_batch({"x": x[lo : lo + batch_size], "y": y[lo : lo + batch_size]}, padded_size)
