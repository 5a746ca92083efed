"""Timing: methods measured in turns, so a change in a shared host's load hits
all of them alike."""

from __future__ import annotations

import dataclasses
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


def time_interleaved(methods: list[Method], steps: int, repeats: int) -> dict[str, list[float]]:
    """Steps/s of `repeats` timed runs of `steps` steps per method, after one
    warm-up run each. The methods take turns within each repeat, so a change
    in the machine's load hits all of them alike (this host is shared)."""
    for m in methods:
        m.run(steps)  # warm-up: thread pools, caches
    rates: dict[str, list[float]] = {m.name: [] for m in methods}
    for _ in range(repeats):
        for m in methods:
            t0 = time.perf_counter()
            m.run(steps)
            rates[m.name].append(steps / (time.perf_counter() - t0))
    return rates


def first_call(name: str, run: Callable[[int], None], k: int = 1) -> Method:
    t0 = time.perf_counter()
    run(k)
    return Method(name, time.perf_counter() - t0, run)


