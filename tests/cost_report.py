"""Where the test session's time goes: per test, the seconds JAX spent
tracing, lowering and compiling (XLA's backend compile), from JAX's own
monitoring events. Off unless DPAX_TEST_COST_DIR names a directory
(conftest.py); each pytest process (xdist worker) writes its own JSON file
there, and `scripts/test_cost_report.py DIR` sums them per file.

Only this process's events count: what the `dpax` processes a test starts
compile is in the test's time, not in these columns.
"""

from __future__ import annotations

import collections
import json
import os

import jax.monitoring

# JAX's event name -> the report's column.
EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/compilation_cache/compile_time_saved_sec": "cache_saved",
}


class CostReport:
    def __init__(self, directory: str):
        self.directory = directory
        self.current = "(outside tests)"
        self.seconds: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, duration: float, **_):
        column = EVENTS.get(event)
        if column is not None:
            self.seconds[self.current][column] += duration
            if column == "compile":
                self.seconds[self.current]["compiles"] += 1

    def start(self, nodeid: str):
        self.current = nodeid

    def finish(self, nodeid: str, duration: float):
        self.seconds[nodeid]["wall"] += duration

    def write(self):
        os.makedirs(self.directory, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(self.directory, f"{worker}-{os.getpid()}.json"), "w") as f:
            json.dump({k: dict(v) for k, v in self.seconds.items()}, f)
