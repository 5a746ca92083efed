"""The training loop: host batches in, one compiled call per step (or per group
of steps), metrics read at log boundaries, periodic host work as hooks.

    for steps, batch in device_calls(...):     # placed ahead of time
        sums = run(steps, batch, sums)          # asynchronous: no host sync
        in_flight.add(sums)                     # bound the queue where asked
        if log is due: row = read(sums); hooks.on_log(step, row)
        hooks.after_step(step)                  # checkpoint, preemption, profile

A hook is clu's `PeriodicAction` idea: a small object with its own trigger.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

from dpax.parallel import watchdog

# Batches made ready this many calls ahead of the step that uses them, so that
# work for batch i+1 overlaps step i.
PREFETCH = 2
# Steps summed on the device before the host takes the sums over in float64
# (it keeps the array and reads it at the next log: no sync). f32 counts stay
# exact for 256 steps of global batches up to 65,536 examples.
STEPS_PER_SUM = 256


class Hook:
    """Host-side work around the loop; a subclass overrides what it needs."""

    def on_start(self, step: int) -> None:
        """Before the first call; `step` steps were trained already."""

    def on_log(self, step: int, row: dict) -> None:
        """At a log boundary, with the metrics row (hooks may add to it)."""

    def after_step(self, step: int) -> None:
        """After each call, when `step` steps are dispatched."""

    def wants_row(self, step: int) -> bool:
        """After each call: whether this hook needs a log row at `step` (an
        evaluation puts its metrics in the row of the step it ran at)."""
        return False


class Every:
    """A trigger for every `n` steps (0: never) that fires once when a call
    crosses a multiple of `n`: with several steps per call, the state exists
    only at call boundaries."""

    def __init__(self, n: int, start: int = 0):
        self.n, self._last = n, start

    def __call__(self, step: int) -> bool:
        last, self._last = self._last, step
        return bool(self.n) and step // self.n > last // self.n


class OnLog(Hook):
    """Calls `fn(step, row)` at every log: the simplest hook."""

    def __init__(self, fn: Callable[[int, dict], None]):
        self.fn = fn

    def on_log(self, step, row):
        self.fn(step, row)


@dataclasses.dataclass
class Steps:
    """What the loop needs of a Trainer's compiled steps."""

    # (steps in the call, device batch, running sums) -> new sums; advances the state
    run: Callable[[int, Any, Any], Any]
    # (padded size, first host batch) -> zero sums, placed like the step's
    zero_sums: Callable[[int, dict], Any]
    # device sums since the last log -> the host row (a sync point)
    read: Callable[[list], dict]
    # (padded size, host batch) pairs -> (steps in the call, device batch) pairs
    place: Callable[[Iterator], Iterator]
    in_flight: int | None  # calls that may queue before the host waits; None: any


def run(steps: Steps, sized_batches: Iterable[tuple[int, dict]], *, start: int,
          total: int | None, log_every: int, hooks: Iterable[Hook] = (),
          steps_per_epoch: int | None = None) -> list[dict]:
    """Run every batch of `sized_batches` ((padded size, host batch) pairs);
    returns the log rows. `total` (if known) is logged whatever `log_every`."""
    hooks = list(hooks)
    batches = iter(sized_batches)
    first = next(batches, None)
    if first is None:
        return []
    # The step's first trace (in `zero_sums`) and compile allocate the most:
    # they run without full collections too.
    with _no_full_collections():
        sums = steps.zero_sums(*first)
        for hook in hooks:
            hook.on_start(start)
        return _run(steps, itertools.chain([first], batches), sums, start, total, log_every,
                    hooks, steps_per_epoch)


def _run(steps: Steps, batches, zero, start, total, log_every, hooks, steps_per_epoch):
    rows: list[dict] = []
    pending: list = []  # device metric sums since the last log, read at the next
    sums, summed = zero, 0  # the running sums and the steps in them
    queue = InFlight(steps.in_flight)
    since = (time.perf_counter(), start)  # the last log's time and step

    def log(step):
        nonlocal pending, since
        with watchdog.waiting(step):
            row = steps.read(pending)  # sync point: once per log
        t, s = since
        elapsed = time.perf_counter() - t
        row.update(step=step, steps_per_sec=(step - s) / elapsed)
        if "weight" in row:  # a weighted loss: e.g. tokens, and tokens per second
            row["weight_per_sec"] = row["weight"] / elapsed
        if steps_per_epoch:
            row["epoch"] = step / steps_per_epoch
        for hook in hooks:
            hook.on_log(step, row)
        rows.append(row)
        pending, since = [], (time.perf_counter(), step)

    step = start
    log_due = Every(log_every, start)
    compiled: set = set()  # the call shapes run once already (watchdog.calling)
    for n, batch in _prefetch(steps.place(batches), PREFETCH):
        step += n
        key = (n, jax.tree.leaves(batch)[0].shape)
        first = key not in compiled and watchdog.active()
        with watchdog.calling(compiled, key, step):
            sums = steps.run(n, batch, sums)
            if first:
                # Untimed, to its end (a sync, once per shape and only under
                # a watchdog): a peer that compiles this step slower joins its
                # collectives here, not inside the next, timed call.
                jax.block_until_ready(sums)
        summed += n
        queue.add(sums["scalars"], step)
        wanted = [hook.wants_row(step) for hook in hooks]  # every hook asked, every call
        log_now = log_due(step) or step == total or any(wanted)
        if log_now or summed >= STEPS_PER_SUM:
            pending.append(sums)
            sums, summed = zero, 0
        if log_now:
            log(step)
        for hook in hooks:
            hook.after_step(step)
    if summed:
        pending.append(sums)
    if pending:
        log(step)
    return rows


class InFlight:
    """Waits for the oldest call once more than `limit` are queued (a wait,
    not a transfer). Training, evaluation and prediction all bound their queue."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._queue: collections.deque = collections.deque()

    def add(self, result, step: int | None = None) -> None:
        """`result`: an output (pytree) of the call just dispatched (at `step`)."""
        if self.limit is None:
            return
        self._queue.append(result)
        if len(self._queue) > self.limit:
            with watchdog.waiting(step):
                jax.block_until_ready(self._queue.popleft())


def device_calls(sized_batches: Iterator, put_batch, put_batches,
                 steps_per_call: int) -> Iterator[tuple[int, Any]]:
    """(steps, device batch) per call: runs of `steps_per_call` batches of one
    size stacked for the scanned step; anything left runs one by one."""
    group: list = []
    for size, batch in sized_batches:
        if steps_per_call == 1:
            yield 1, put_batch(batch, size)
            continue
        if group and group[0][0] != size:
            yield from ((1, put_batch(b, s)) for s, b in group)
            group = []
        group.append((size, batch))
        if len(group) == steps_per_call:
            yield steps_per_call, put_batches([b for _, b in group], size)
            group = []
    yield from ((1, put_batch(b, s)) for s, b in group)


# A threshold for full collections that is never reached while the loop runs.
NO_FULL_COLLECTIONS = 2**30


@contextlib.contextmanager
def _no_full_collections():
    """Keep Python's cyclic collector to its young generations while the loop
    runs: a full collection walks every object JAX, the model and the data keep
    alive, and pauses the loop for as long as that walk takes, longer than a
    small model's steps. Cycles made during the loop are still collected
    young; the thresholds are restored after.

    Not `gc.freeze()`: only `gc.unfreeze()` undoes it, which unfreezes what
    others froze too, and Python 3.12 starts with objects frozen, so a freeze
    left in place grew with every `fit` call, and counting it walked every
    frozen object at each call."""
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(t0, t1, NO_FULL_COLLECTIONS)
    try:
        yield
    finally:
        if gc.get_threshold() == (t0, t1, NO_FULL_COLLECTIONS):  # unless changed meanwhile
            gc.set_threshold(t0, t1, t2)


def _prefetch(items: Iterator, depth: int) -> Iterator:
    """Yield from `items` while keeping `depth` more already produced (placed)."""
    queue: collections.deque = collections.deque()
    for item in items:
        queue.append(item)
        if len(queue) > depth:
            yield queue.popleft()
    while queue:
        yield queue.popleft()
