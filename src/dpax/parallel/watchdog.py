"""A watchdog instead of a hang.

In a multi-process run, a rank that stops (a frozen host, SIGSTOP, a network
partition) leaves its peers waiting inside a collective forever, with no word.
While a watchdog is installed, every wait of the training loop on its devices
(`waiting`) is timed; one that lasts longer than `timeout` prints which rank
stalled at which step, then the Python stack of every thread of the process,
and calls its `on_stall`: the `dpax` command's ends the process with exit
code 5, so that `dpax launch` or the scheduler can stop and restart the run
from its newest checkpoint.

Only waits are timed, never compilation or host work: the loop bounds the
calls in flight (`dpax.parallel.platform`), so one wait is at most a couple
of steps long when all ranks are alive. A call of a compiled step is a wait
too (`calling`): XLA:CPU runs small programs on the calling thread, where a
stopped peer hangs it; its first call per shape compiles, and is not timed.
Every host read of a device value is a wait too (a metric, the finite check
before a save): one left untimed hangs until JAX's heartbeat abort, with no
report from here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
from collections.abc import Callable, Iterator


class Watchdog:
    """Times the waits of one process; a daemon thread checks them."""

    def __init__(self, timeout: float, rank: int, stream=None,
                 on_stall: Callable[[], None] | None = None):
        self.timeout, self.rank = timeout, rank
        self.stream = stream or sys.stderr
        # Called from the watchdog's thread: the main thread is stuck in the
        # wait, so only ending the process (os._exit) gets it out.
        self.on_stall = on_stall
        self.step = 0  # the step the loop is at, for the message
        self._since: float | None = None  # when the current wait began
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dpax-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    @contextlib.contextmanager
    def waiting(self, step: int | None = None) -> Iterator[None]:
        if step is not None:
            self.step = step
        # A wait inside a wait (a sync point inside a save) is part of the outer
        # one: the outer's start counts, and the outer stays timed after it.
        outer = self._since
        if outer is None:
            self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = outer

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout / 4)):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                self._fire(time.monotonic() - since)

    def _fire(self, waited: float) -> None:
        out = self.stream
        print(f"dpax: rank {self.rank} stalled: waited {waited:.0f}s for its devices at step "
              f"{self.step} (a peer that stopped or died?); its Python stacks follow",
              file=out, flush=True)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        if self.on_stall is not None:
            self.on_stall()
        self.stop()  # reported once


_current: Watchdog | None = None


@contextlib.contextmanager
def installed(timeout: float, rank: int, stream=None,
              on_stall: Callable[[], None] | None = None) -> Iterator[Watchdog]:
    """A watchdog on this process's waits for the duration of the block.
    `on_stall` runs once a wait passed `timeout` and the report is printed;
    without one the wait goes on (the `dpax` command's ends the process)."""
    global _current
    dog = Watchdog(timeout, rank, stream, on_stall).start()
    previous, _current = _current, dog
    try:
        yield dog
    finally:
        _current = previous
        dog.stop()


def active() -> bool:
    """Whether a watchdog is installed (a multi-process run's)."""
    return _current is not None


def waiting(step: int | None = None):
    """The installed watchdog's timer around a wait on the devices (a no-op
    without one)."""
    return contextlib.nullcontext() if _current is None else _current.waiting(step)


def calling(seen: set, key, step: int | None = None):
    """The timer around a call of a compiled program (module docstring), but
    for its first call per `key` (e.g. the batch shape), which compiles;
    `seen` remembers the keys."""
    if key in seen:
        return waiting(step)
    seen.add(key)
    return contextlib.nullcontext()
