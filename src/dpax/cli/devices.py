"""`dpax devices`, and what every command does first: simulated CPU devices
and the multi-process runtime, before JAX starts its backend."""

from __future__ import annotations

import argparse
import os

import jax

from dpax.errors import DpaxError, summary
from dpax.parallel.distributed import DistributedConfig, initialize
from dpax.parallel.mesh import describe, simulate_devices

NAME = "devices"


def start(devices: int | None = None, distributed: DistributedConfig | None = None) -> None:
    """On CPU hosts a single process gets 8 simulated devices (or `devices` of
    them, a subset used); each process of a multi-process run (from flags, or
    from a SLURM or Kubernetes environment) gets exactly `devices`.
    Accelerators are unaffected."""
    distributed = (distributed or DistributedConfig()).from_environment()
    if distributed.processes > 1:
        simulate_devices(devices or 8)
    else:
        simulate_devices(max(devices or 8, 8))
    initialize(distributed)
    backend_started()


def backend_started() -> None:
    """JAX's backend, started now (every command, `start` or not): a platform it
    cannot start (JAX_PLATFORMS=cuda on a host without CUDA) failed later as
    an AssertionError inside JAX."""
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        platforms = os.environ.get("JAX_PLATFORMS")
        why = f" ({summary(e, 160)})" if str(e) else ""
        if platforms:
            raise DpaxError(f"JAX cannot start a backend for JAX_PLATFORMS={platforms} on this "
                            f"host{why}: install that platform's jax plugin, or unset "
                            "JAX_PLATFORMS") from None
        raise DpaxError(f"JAX cannot start a backend on this host{why}: reinstall jax and "
                        "jaxlib (make setup)") from None


def add_parser(sub) -> None:
    sub.add_parser(NAME, help="print the devices JAX sees")


def run(args: argparse.Namespace) -> int:
    start()
    print(describe())
    return 0
