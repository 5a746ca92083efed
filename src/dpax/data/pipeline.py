"""Host input pipeline on Grain: which examples form the batch of each step.

Batch `s` depends only on the seed and `s`, never on the device count: epoch
`e = s // steps_per_epoch` is a fresh permutation of all examples drawn from
(seed, e), cut into batches of the global batch size; the last batch of an
epoch is short and gets padded, never dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np

from dpax.data import checks
from dpax.data.augment import Augment
from dpax.data.batches import INDEX, MASK, ROWS, Batch, batch_rows, pad_batch, padded_size
from dpax.errors import BadExamples, DpaxError

EVAL_BATCH = 256  # global batch of evaluation and prediction, unless given


def examples(data: Any, y: Any = None, argument: str = "data") -> dict:
    """The examples as a dict of arrays that share a leading example axis:
    `data` itself (values may be nested dicts, or `dpax.data.sources` columns read
    from disk per batch), or `{"x": data, "y": y}` for an array `data`.
    `argument`: what the caller calls `data`, for its errors (`checks.Examples`)."""
    positional = not isinstance(data, Mapping)
    if positional:
        data = {"x": data} if y is None else {"x": data, "y": y}
    elif y is not None:
        raise BadExamples("give `y` only with an array of inputs; a dict of examples holds "
                          "its targets under a key of its own", "y", "y")
    for key, what, other in ((MASK, "the real rows", "attention_mask"),
                             (INDEX, "the global positions", "position")):
        if key in data:
            raise BadExamples(f"the examples have a key {key!r}, which dpax adds to every "
                              f"batch ({what}); rename yours, e.g. {other!r}", argument, key)
    data = dict(data)
    checks.structure(checks.Examples(data, argument, positional))
    return data


def check_length(steps: int | None, epochs: int | None, steps_name: str = "steps") -> None:
    """A run's length is `steps` or `epochs`, not both, each >= 1."""
    if steps is not None and epochs is not None:
        raise DpaxError(f"give exactly one of `{steps_name}` or `epochs`, not both")
    for name, value in ((steps_name, steps), ("epochs", epochs)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise DpaxError(f"`{name}` must be a whole number >= 1, got {value!r}")
        if value < 1:
            raise DpaxError(f"`{name}` must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Epoch-aligned global batches over `n_examples`, in a seeded order."""

    n_examples: int
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return padded_size(self.n_examples, self.batch_size) // self.batch_size

    def total_steps(self, steps: int | None = None, epochs: int | None = None,
                    default_epochs: int | None = None, steps_name: str = "steps") -> int:
        """Steps of a run: `steps`, else `epochs` passes (else `default_epochs`).
        `steps_name` is what the caller calls `steps`, for its errors."""
        check_length(steps, epochs, steps_name)
        epochs = epochs if steps is not None or epochs is not None else default_epochs
        if steps is None and epochs is None:
            raise DpaxError(f"give exactly one of `{steps_name}` or `epochs`")
        return steps if steps is not None else epochs * self.steps_per_epoch

    def indices(self, step: int) -> np.ndarray:
        """Example indices of global batch `step`, in order."""
        epoch, j = divmod(step, self.steps_per_epoch)
        order = epoch_order(self.n_examples, self.seed, epoch)
        return order[j * self.batch_size : (j + 1) * self.batch_size]


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) drawn from (seed, epoch) alone.

    Vectorized on purpose: Grain's per-element `MapDataset.shuffle` works one
    index at a time in Python, too slow to feed a fast accelerator at large
    batches. Grain still runs the pipeline (the iterator and its
    checkpointable state).
    """
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False  # cached and shared: nobody may shuffle it in place
    return order


def local_part(data: dict, idx: np.ndarray, rows: tuple[int, int]) -> Batch:
    """Rows [lo, hi) of the padded global batch whose examples are `idx`: only
    this process's examples are read; positions past len(idx) are padding,
    copies of this process's first example (`pad_batch`), or of the global
    batch's first where the process holds none."""
    lo, hi = rows
    mine = idx[lo:hi]
    holds_none = len(mine) == 0 and len(idx) > 0
    fill = jax.tree.map(lambda a: a[idx[:1]], data) if holds_none else None
    return pad_batch(jax.tree.map(lambda a: a[mine], data), hi - lo, fill)


# Bytes of batches built in one piece: small batches come CHUNK_STEPS at a time
# (one gather, one Grain element), large ones one at a time.
CHUNK_BYTES = 1 << 20
CHUNK_STEPS = 64
READ_THREADS = 2  # Grain threads that read ahead from disk (see `train_batches`)


def train_batches(
    data: dict, plan: BatchPlan, rows: tuple[int, int], start: int, stop: int,
    augment: Augment | None = None, workers: int = 0,
) -> StepBatches:
    """This process's rows of the padded, masked global batches of steps
    `start..stop-1`, as a checkpointable iterator.

    Built on the calling thread by default: the Trainer dispatches steps
    asynchronously, so batch i+1 is already made while the device runs step i;
    a worker thread's handoffs would cost more than a small model's whole step.
    Inputs on disk (`dpax.data.sources`) are read ahead by `READ_THREADS` Grain
    threads, which wait for storage while the steps run; `workers` > 0 builds
    the batches in that many Grain worker processes instead, for reads and
    decoding one process cannot keep up with. Grain's own bookkeeping is per
    element, so small batches come in chunks of several steps: one element
    per chunk spreads that bookkeeping over its steps.
    """
    # From shapes: reading a row of inputs on disk (`dpax.data.sources`) costs a read.
    arrays = jax.tree.leaves(data)
    row_bytes = sum(np.dtype(a.dtype).itemsize * math.prod(a.shape[1:]) for a in arrays)
    # Sized by the GLOBAL batch, never by this process's rows: the same chunks
    # for any device count.
    per_chunk = int(np.clip(CHUNK_BYTES // max(row_bytes * plan.batch_size, 1),
                            1, CHUNK_STEPS))

    # Inputs on disk wait for reads (the GIL released): threads read ahead,
    # overlapping the wait with the steps. Arrays in memory need no wait.
    threads = READ_THREADS if any(getattr(a, "on_disk", False) for a in arrays) else 0

    def chunks(first: int):
        ds = grain.MapDataset.range(first, stop, per_chunk).map(
            _Chunk(data, plan, rows, stop, per_chunk, augment))
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads,
                                                  prefetch_buffer_size=threads * 2))
        if workers:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's workers read its absl flags: defaults
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers),
                                worker_init_fn=functools.partial(_exit_with, os.getpid()))
        return iter(ds)

    return StepBatches(chunks, start, per_chunk)


def _exit_with(parent: int, *_) -> None:
    """Runs in each Grain worker: exit once the training process is gone, so a
    `kill -9` of a run leaves no worker behind."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


class _Chunk(grain.transforms.Map):
    """The batches of steps first..first+per_chunk-1 (a module-level class:
    Grain workers get it pickled). A `Map`, so that Grain names it by its
    class: it named a `functools.partial` by its repr, which printed the
    examples it holds, at every `fit` call and restore."""

    def __init__(self, data: dict, plan: BatchPlan, rows: tuple[int, int], stop: int,
                 per_chunk: int, augment: Augment | None):
        self.data, self.plan, self.rows, self.stop = data, plan, rows, stop
        self.per_chunk, self.augment = per_chunk, augment

    def map(self, first: int) -> list[Batch]:
        steps = range(first, min(first + self.per_chunk, self.stop))
        return local_parts(self.data, self.plan, self.rows, steps, self.augment)


def local_parts(data: dict, plan: BatchPlan, rows: tuple[int, int], steps: range,
                augment: Augment | None = None) -> list[Batch]:
    """`local_part` of the global batches of `steps`: one gather when none of
    them needs padding (then they share one mask array: read-only to callers).
    `augment` changes each step's inputs `x` by (seed, step, global position)."""
    lo, hi = rows
    mine = [plan.indices(s)[lo:hi] for s in steps]
    if any(len(m) != hi - lo for m in mine):
        parts = [local_part(data, plan.indices(s), rows) for s in steps]
    else:
        idx = np.concatenate(mine)

        def by_step(a):
            got = a[idx]
            return got.reshape((len(mine), hi - lo) + got.shape[1:])

        gathered = jax.tree.map(by_step, data)
        mask = np.ones(hi - lo, bool)
        parts = [{**jax.tree.map(lambda a, i=i: a[i], gathered), MASK: mask}
                 for i in range(len(mine))]
    if augment is not None:
        parts = [dict(p, x=augment(p["x"], plan.seed, s, lo, plan.batch_size))
                 for p, s in zip(parts, steps)]
    return parts


class StepBatches:
    """One batch per step from a Grain iterator of chunks (lists of batches).

    Its state is the step of the next batch; a restore starts the chunks anew
    at that step. Batches depend on the step alone, so this is exact whatever
    the device count, chunk size or Grain worker count of the saving run.
    """

    def __init__(self, chunks: Callable[[int], Iterator], start: int, per_chunk: int):
        self._make, self._step, self._per_chunk = chunks, start, per_chunk  # `_step`: next
        self._chunks = chunks(start)
        self._chunk: list[Batch] = []
        self._offset = 0

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._offset == len(self._chunk):
            self._chunk, self._offset = next(self._chunks), 0
        self._offset += 1
        self._step += 1
        return self._chunk[self._offset - 1]

    def get_state(self) -> dict:
        return {"step": self._step}

    def set_state(self, state: dict) -> None:
        # dpax 0.1 saved Grain's chunk index and the offset in the chunk, its
        # chunks starting at step 0 (`run` checks the step against the
        # checkpoint's and starts from the latter if they differ).
        step = state["step"] if "step" in state else (
            state["chunks"].get("next_index", 0) * self._per_chunk + state["offset"])
        self.close()
        self.__init__(self._make, step, self._per_chunk)

    def close(self) -> None:
        """Stop Grain's worker processes, if any."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


def bucketed(batches: Iterable[dict], unit: int, buckets: Sequence[int] | None,
             local_rows: Callable[[int], tuple[int, int]]) -> Iterator[tuple[int, Batch]]:
    """(padded size, this process's part) of host batches of ANY size: each is
    padded to the smallest bucket that holds it, so a step compiles once per
    bucket. Buckets are multiples of `unit` (devices x micro-batches); default:
    `unit` times powers of two."""
    if buckets is not None:
        buckets = sorted(buckets)
        if any(b % unit for b in buckets):
            raise DpaxError(f"every bucket must be a multiple of {unit} "
                            f"(devices x `grad_accum`), got {buckets}")
    for batch in batches:
        batch = examples(batch, argument="batches")
        b = batch_rows(batch)
        size = _bucket(b, unit, buckets)
        yield size, local_part(batch, np.arange(b), local_rows(size))


def _bucket(b: int, unit: int, buckets: Sequence[int] | None) -> int:
    if buckets is None:
        size = unit
        while size < b:
            size *= 2
        return size
    for size in buckets:
        if size >= b:
            return size
    raise DpaxError(f"a batch of {b} examples is larger than the largest bucket {buckets[-1]}")


def eval_batches(data: dict, batch_size: int, rows: tuple[int, int]):
    """This process's rows of sequential padded, masked global batches that
    cover every example exactly once."""
    n = batch_rows(data)
    for start in range(0, n, batch_size):
        yield local_part(data, np.arange(start, min(start + batch_size, n)), rows)


class TrainedPosition:
    """A Grain iterator whose checkpointed position is the last batch TRAINED
    on, not the last one read: the Trainer reads ahead to overlap transfers.

    Saved and restored by `grain.checkpoint.CheckpointSave/Restore` like the
    iterator itself (state as JSON bytes).
    """

    def __init__(self, iterator, holds_indices: bool = False):
        self._it = iterator
        self.holds_indices = holds_indices  # batches of example indices (`train_input`)
        self._read: collections.deque[dict] = collections.deque()  # after each read
        self._trained = self._it.get_state()

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        # A fresh dict per call (Grain's own); encoded only when saved.
        self._read.append(self._it.get_state())
        return batch

    def trained(self, n: int) -> None:
        """`n` more of the batches read so far have been trained on."""
        for _ in range(n):
            self._trained = self._read.popleft()

    def get_state(self) -> bytes:
        return json.dumps(self._trained).encode()

    @property
    def next_step(self) -> int | None:
        """The step of the next batch to train on, if the iterator says."""
        return self._trained.get("step") if isinstance(self._trained, dict) else None

    def set_state(self, state: bytes) -> None:
        """Go to a saved position."""
        saved = json.loads(state)
        self._it.set_state(saved)
        self._trained, self._read = saved, collections.deque()

    def close(self) -> None:
        self._it.close()

    def start_prefetch(self) -> None:
        """Called by Grain's `CheckpointRestore` handler after `set_state`. Batches
        are built on the training thread (see `train_batches`): nothing to start."""


def train_input(data: dict, plan: BatchPlan, rows: tuple[int, int], start: int, stop: int,
                augment: Augment | None = None, workers: int = 0,
                indices: bool = False) -> TrainedPosition:
    """The input pipeline of a training run: this process's rows of the padded,
    masked global batches of steps `start..stop-1`, checkpointable at the last
    batch trained on. `Trainer.fit` takes it as `batches`. `indices`: batches
    of the examples' indices (`ROWS`) instead, for examples kept on the
    devices (`dpax.data.resident`); the same position, saved and restored
    interchangeably with the examples' pipeline."""
    if indices:
        data, augment, workers = {ROWS: np.arange(batch_rows(data), dtype=np.int32)}, None, 0
    return TrainedPosition(iter(train_batches(data, plan, rows, start, stop, augment, workers)),
                           holds_indices=indices)
