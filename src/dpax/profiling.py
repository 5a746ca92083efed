"""`--profile-steps A:B`: a JAX profiler trace of exactly steps A..B."""

from __future__ import annotations

import os

import jax


class StepProfiler:
    """Starts the trace before step A and stops it once step B has finished.

    The trace (`*.xplane.pb` for TensorBoard's profile plugin, `*.trace.json.gz`
    for ui.perfetto.dev) lands under `logdir/plugins/profile/<run>/`.
    """

    def __init__(self, logdir: str, first: int, last: int):
        self.logdir, self.first, self.last = logdir, first, last
        self.active = False

    def before(self, step: int) -> None:
        """Call before step `step` (1-based) is dispatched."""
        if step == self.first and not self.active:
            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, trainer) -> None:
        """Call after step `step` was dispatched by `trainer`."""
        if self.active and step >= self.last:
            jax.block_until_ready(trainer.state)  # the trace must hold the step's device work
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
