"""What a run does differently on XLA:CPU, behind one switch that is off by default.

Every run takes the generic path unless asked otherwise: JAX's own backward
pass, XLA's default compile options, one plain `psum` of the gradient tree, a
rolled `scan` for several steps per call. It is the path GPUs and TPUs take,
and the one the equivalence tests prove.

On CPU devices a run can opt into dpax's XLA:CPU tuning (`xla_cpu_tuning=True`,
or `DPAX_XLA_CPU_TUNING=1` in the environment): the step then takes what
`dpax.xla_cpu` measured faster on XLA:CPU: its backward rewrite, compile
options chosen per step by timing candidates, small all-reduce operands packed
into one buffer behind a barrier, an unrolled scan. What it may change: its
timed choices (a dot's form, YNNPACK's kernels for sums) can round the last
bits of the gradient, hence of the params, differently from the generic path.
They are kept per machine (`dpax.xla_cpu.choices`), so every tuned run there
takes the same ones; the first tuned step on a machine waits while they are
timed. `dpax.xla_cpu` is imported here only, and only for CPU devices with the
tuning on: a JAX release that moves the internals it uses cannot break GPU or
TPU runs, nor untuned ones.

One thing stays on CPU whatever the switch, because it prevents a failure
rather than a slowdown: XLA:CPU's cross-device rendezvous aborts ("Termination
timeout for all reduce") when too many multi-device calls are queued, so at
most `MAX_IN_FLIGHT` are. A multi-process run bounds them on every
platform, so that a rank whose peer stopped waits at most a couple of steps'
time while all are alive (`dpax.parallel.watchdog` times the waits). Neither
changes a number.

This module imports JAX only inside functions: a `dpax` command line that asks
for the tuning (`dpax.__main__`) calls `restart_for_tuning` before JAX is
imported, to restart its process with glibc's huge pages for the tuned step's
temporaries.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dpax.errors import DpaxError

if TYPE_CHECKING:
    import jax

# Turns the XLA:CPU tuning off (0) or on (1) where `xla_cpu_tuning` is not given.
ENV = "DPAX_XLA_CPU_TUNING"
MAX_IN_FLIGHT = 2


def _plain_jit(build: Callable[[dict], Any]) -> Any:
    return build({})


@dataclasses.dataclass(frozen=True)
class Platform:
    """How the steps of one Trainer are built for its devices' platform."""

    name: str  # "cpu", "gpu", "tpu", ...
    xla_cpu_tuning: bool
    # Wraps the per-device gradient function (`jax.value_and_grad(...)`), or None.
    backward: Callable[[Callable], Callable] | None = None
    # `compile(build)`: a jitted step from `build(compiler_options) -> jax.jit(...)`.
    compile: Callable[[Callable[[dict], Any]], Any] = _plain_jit
    pack_collectives: bool = False  # small all-reduce operands in one buffer
    unroll_steps: bool = False  # several steps per call as an unrolled scan
    max_in_flight: int | None = None  # calls queued before the host waits; None: any


def tuning_default() -> bool:
    """`xla_cpu_tuning` when not given: off, unless `DPAX_XLA_CPU_TUNING=1`."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise DpaxError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def restart_for_tuning() -> None:
    """For a process that will run tuned steps, before JAX is imported:
    restart once with glibc's huge pages where JAX computes on the CPU
    (`dpax.xla_cpu.hostenv`). Returns when there is nothing to do."""
    from dpax.xla_cpu.hostenv import restart_with_hugepages

    restart_with_hugepages()


def for_devices(devices: Sequence[jax.Device], xla_cpu_tuning: bool | None = None,
                processes: int | None = None) -> Platform:
    """The platform of `devices`; `xla_cpu_tuning` (None: `tuning_default()`)
    matters only for CPU devices. `processes`: of the run (default: JAX's)."""
    import jax  # here: the command imports this module before JAX

    name = devices[0].platform
    several = (jax.process_count() if processes is None else processes) > 1
    if name != "cpu":
        return Platform(name, xla_cpu_tuning=False,
                        max_in_flight=MAX_IN_FLIGHT if several else None)
    in_flight = MAX_IN_FLIGHT if len(devices) > 1 or several else None
    tuned = tuning_default() if xla_cpu_tuning is None else xla_cpu_tuning
    if not tuned:
        return Platform(name, xla_cpu_tuning=False, max_in_flight=in_flight)
    # Imported here, for CPU devices only: the gate the module docstring describes.
    from dpax.xla_cpu.backward import for_xla_cpu
    from dpax.xla_cpu.compile_options import ChosenJit

    return Platform(name, xla_cpu_tuning=True, backward=for_xla_cpu, compile=ChosenJit,
                    pack_collectives=True, unroll_steps=True, max_in_flight=in_flight)
