"""Timing: methods measured in turns, so a change in a shared host's load hits
all of them alike, in an order that changes, so that none always follows the
same method."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable


@dataclasses.dataclass
class Method:
    """One way to train a workload: `run(k)` trains k steps and waits for them."""

    name: str
    compile_s: float  # the first call: tracing, compiling, placing the state
    run: Callable[[int], None]
    memory: float = float("nan")  # bytes per device the step needs, when known
    state: float = float("nan")  # bytes of params + optimizer state per device at rest
    comms: dict | None = None  # the step's collectives and their minimum (`step_comms`)


def turns(n_methods: int, repeats: int) -> list[list[int]]:
    """The order of the methods in each repeat: a Williams design, the
    crossover trials' answer to carry-over. Every method takes every position,
    and within a repeat follows every other method equally often: once per
    `n_methods` repeats (twice per 2 x `n_methods` when that is odd). XLA:CPU
    runs a step slower right after some other programs (the bench's cnn on 2
    devices: 5-10% slower right after the tuned dpax step), so a fixed order
    would charge that to whichever method always came next."""
    n = n_methods
    # 0, 1, n-1, 2, n-2, ...: each difference between neighbours occurs once.
    first = [(j + 1) // 2 if j % 2 else (n - j // 2) % n for j in range(n)]
    rows = [[(m + r) % n for m in first] for r in range(n)]
    if n % 2:  # an odd square balances with its mirror image
        rows += [row[::-1] for row in rows]
    return [rows[r % len(rows)] for r in range(repeats)]


def repeat_steps(methods: list[Method], steps: int, min_seconds: float = 0.0) -> int:
    """Runs each method once for `steps` steps (the warm-up: thread pools,
    caches) and returns the steps a timed repeat takes: `steps` doubled until
    the fastest method's run would last `min_seconds`.

    A dpax repeat is one `Trainer.fit` call, and a call has a fixed cost (its
    start and the trained state left in the user's model, ~5 ms for the
    bench's GPT) that a run pays once. A workload's steps are sized for a CPU
    step; on an H100 the GPT's 16 steps last ~40 ms, and that cost decided
    the row (0.86x the jit loop, 48.2 ms a repeat against 41.4)."""
    fastest = float("inf")
    for m in methods:
        t0 = time.perf_counter()
        m.run(steps)
        fastest = min(fastest, time.perf_counter() - t0)
    if 0 < fastest < min_seconds:
        steps *= 2 ** math.ceil(math.log2(min_seconds / fastest))
    return steps


def time_interleaved(methods: list[Method], steps: int, repeats: int,
                     warm_up: bool = True) -> dict[str, list[float]]:
    """Steps/s of `repeats` timed runs of `steps` steps per method, after one
    warm-up run each (unless `warm_up` is False: `repeat_steps` ran them).
    The methods take turns within each repeat, so a change in the machine's
    load hits all of them alike (this host is shared), in an order that
    changes from repeat to repeat (`turns`)."""
    if warm_up:
        repeat_steps(methods, steps)
    rates: dict[str, list[float]] = {m.name: [] for m in methods}
    for order in turns(len(methods), repeats):
        for m in (methods[i] for i in order):
            t0 = time.perf_counter()
            m.run(steps)
            rates[m.name].append(steps / (time.perf_counter() - t0))
    return rates


def first_call(name: str, run: Callable[[int], None], k: int = 1) -> Method:
    t0 = time.perf_counter()
    run(k)
    return Method(name, time.perf_counter() - t0, run)


