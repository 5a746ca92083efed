"""glibc's malloc settings for XLA:CPU steps with large temporaries (opt-in).

XLA:CPU allocates each step's temporaries with one malloc and frees them
after the step. glibc serves a block over its mmap threshold (32 MiB at most)
from a fresh mmap, which the kernel faults in and zeroes 4 KiB at a time, on
every step. Most dpax steps stay under the threshold; a step with more (a
conv net at a large per-device batch) can call `tune_malloc()` first thing:
no mmap for large blocks, and the heap's top kept up to 1 GiB when freed.
Not the default: on steps with small temporaries and many devices it costs
time (benchmarks/README.md, "Host allocator"), and the process keeps up to
1 GiB it freed. From the command line, `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`
(glibc 2.35+) asks for transparent huge pages on such blocks instead.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping

# mallopt's parameters (malloc.h) and the values tune_malloc gives them.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREED = 1 << 30
_DETECT = object()  # look at this machine (tests pass the answers instead)


def _glibc_version() -> tuple[int, ...] | None:
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


# Modules an accelerator's PJRT plugin installs (CUDA and ROCm plugins live in
# the `jax_plugins` namespace package; TPUs come with `libtpu`).
ACCELERATOR_MODULES = ("jax_plugins", "libtpu")


def computes_on_cpu(environ: Mapping[str, str] = os.environ, installed=_DETECT) -> bool:
    """Whether JAX will run on XLA:CPU, judged without importing JAX: the first
    platform JAX_PLATFORMS names, else whether an accelerator plugin is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if installed is _DETECT:
        installed = [m for m in ACCELERATOR_MODULES if importlib.util.find_spec(m)]
    return not installed


def tune_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Serve large blocks from the heap and keep its freed top (see the
    module's docstring), where JAX computes on the CPU with glibc; True when
    applied. Opt-in, for a script whose steps have large temporaries: call it
    first thing."""
    if not (computes_on_cpu(environ) and sys.platform.startswith("linux") and _glibc_version()):
        return False
    mallopt = ctypes.CDLL(None).mallopt  # this process's libc
    return all(mallopt(param, value) == 1
               for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_FREED)))
