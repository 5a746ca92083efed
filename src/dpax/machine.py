"""This machine as dpax's measurements know it: what dpax measures on a
machine (the peak FLOP/s behind MFU, `dpax.parallel.peak`; the XLA:CPU
tuning's timed choices, `dpax.xla_cpu.choices`) is kept in one cache
directory, under the key of the machine it was measured on.

Both the parallel engine and the XLA:CPU tuning read it, so it sits below
both: the tuning imports no engine module (`tests/test_structure.py`).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import jax

CACHE_ENV = "DPAX_CACHE_DIR"  # where measurements are kept (default ~/.cache/dpax)


def machine_key(device) -> str:
    """What a measurement belongs to: the processor, its cores and the JAX
    that compiles for it (a new XLA may run matmuls faster)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return f"{device.platform}|{getattr(device, 'device_kind', '')}|{cpu}|" \
           f"{os.cpu_count()} cores|jax {jax.__version__}"


def versions() -> str:
    """dpax's version and its stack's on one line, as a bug report wants them
    (`dpax --version`); from the installed packages, JAX is not started."""
    from dpax import __version__

    stack = []
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"):
        try:
            stack.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"dpax {__version__} ({', '.join(stack)}, Python {platform.python_version()})"


def cache_dir() -> str:
    """Where dpax keeps what it measured on this machine (peaks, `dpax.xla_cpu.dots`)."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dpax")
