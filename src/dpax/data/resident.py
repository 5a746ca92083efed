"""Examples kept on the devices: whether `Trainer.fit` copies the training
arrays to every device once and gathers each batch there.

Each step then takes only the batch's example indices and mask from the host
(a few bytes a row) instead of its examples, and the host skips the row
gather: on a fast accelerator a small model's step is shorter than the
host's gather and copy of its batch, so the host, not the device, set the
pace. The batches are the host pipeline's, row for row
(`dpax.data.batches.gather_rows`), so the numbers do not change.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from dpax.errors import DpaxError

# By default the examples take at most this share of each device's FREE memory
# when `fit` starts: the model and its optimizer state are placed by then, and
# the rest is left to the step's activations.
AUTO_SHARE = 0.125


def nbytes(data: dict) -> int:
    return sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in jax.tree.leaves(data))


def why_not(data: dict, *, batches_given: bool, augment: bool, workers: int) -> str | None:
    """Why these examples cannot be gathered on the devices; None if they can."""
    if batches_given:
        return "the batches come from `batches`, not from the examples"
    if augment:
        return "`augment` changes each batch on the host"
    if workers:
        return "`data_workers` build the batches in other processes"
    if not all(isinstance(a, (np.ndarray, jax.Array)) for a in jax.tree.leaves(data)):
        return "some examples are `dpax.data.sources` columns, read and decoded per batch"
    return None


def free_memory(devices: Sequence[jax.Device]) -> int | None:
    """The least free memory of `devices` in bytes (limit less in use), where
    the runtime says."""
    free = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)


def choose(requested: bool | None, data: dict, devices: Sequence[jax.Device], platform: str,
           processes: int = 1, **context) -> bool:
    """Whether `fit` keeps `data` on `devices`. `requested` None: yes on
    accelerators, in a single-process run, when the examples take at most
    `AUTO_SHARE` of a device's free memory. Not on CPU devices: their memory is the
    host's, each one would hold one more copy, and it measured within the
    noise there. True where it cannot be is an error naming why."""
    if requested is False:
        return False
    reason = why_not(data, **context)
    if requested:
        if reason:
            raise DpaxError(f"`data_on_device=True`, but {reason}; leave it out")
        return True
    # Several processes: only where asked. Each places all of it on its devices;
    # exact (tests/test_multiprocess.py launches it), but unmeasured on hosts
    # with accelerators.
    if reason or platform == "cpu" or processes > 1:
        return False
    memory = free_memory(devices)
    return memory is not None and nbytes(data) <= AUTO_SHARE * memory
