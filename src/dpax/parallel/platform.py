"""What a run does differently on XLA:CPU, behind one switch.

GPU and TPU runs take the generic path: JAX's own backward pass, XLA's
default compile options, one plain `psum` of the gradient tree, a rolled
`scan` for several steps per call. On CPU devices, with the XLA:CPU tuning on
(the default there), the step takes what `dpax.xla_cpu` measured faster on
XLA:CPU: its backward rewrite, compile options chosen per step, small
all-reduce operands packed into one buffer behind a barrier, an unrolled
scan. Its timed choices (a dot's form, YNNPACK's kernels for sums) can round
the last bits differently from the generic path; they are kept per machine
(`dpax.xla_cpu.choices`), so every run there takes the same ones.
`dpax.xla_cpu` is imported here only, and only for CPU devices with the
tuning on: a JAX release that moves the internals it uses cannot break GPU
or TPU runs.

One thing stays on CPU whatever the switch, because it prevents a failure
rather than a slowdown: XLA:CPU's cross-device rendezvous aborts ("Termination
timeout for all reduce") when too many multi-device calls are queued, so at
most `MAX_IN_FLIGHT` are. A multi-process run bounds them on every
platform, so that a rank whose peer stopped waits at most a couple of steps'
time while all are alive (`dpax.parallel.watchdog` times the waits). Neither
changes a number.

The `dpax` command also sets up its process for XLA:CPU before JAX starts
(`prepare_process`: glibc's huge pages for the step's temporaries,
`dpax.xla_cpu.hostenv`), behind the same switch. This module imports JAX only
inside functions, so that the command can ask it before JAX is imported.
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
    """`xla_cpu_tuning` when not given: on, unless `DPAX_XLA_CPU_TUNING=0`."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise DpaxError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def prepare_process(argv: Sequence[str]) -> None:
    """What the `dpax` command does first, before JAX is imported, when its
    command line `argv` computes (train, bench, ...): with the XLA:CPU tuning
    on, restart once with glibc's huge pages where JAX computes on the CPU
    (`dpax.xla_cpu.hostenv`). Returns when there is nothing to do."""
    if "--no-xla-cpu-tuning" in argv or os.environ.get(ENV, "1").strip() != "1":
        return  # off, or a bad value that the command itself reports
    from dpax.xla_cpu.hostenv import restart_with_hugepages

    restart_with_hugepages()


def for_devices(devices: Sequence[jax.Device], xla_cpu_tuning: bool | None = None,
                processes: int | None = None) -> Platform:
    """The platform of `devices`; `xla_cpu_tuning` (None: `tuning_default()`)
    matters only for CPU devices. `processes`: of the run (default: JAX's)."""
    import jax  # here: `prepare_process` runs before JAX is imported

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
