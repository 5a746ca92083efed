"""glibc's malloc settings for XLA:CPU steps with large temporaries.

XLA:CPU allocates each step's temporaries with one malloc and frees them
after the step. glibc serves a block over its mmap threshold (32 MiB at most)
from a fresh mmap, which the kernel faults in and zeroes 4 KiB at a time, on
every step: a step with large temporaries (the GPT's, a conv net's) then
spends a large share of its time in page faults (docs/speed.md, "The host
allocator").

- With the XLA:CPU tuning asked for, the `dpax` command restarts itself once,
  before JAX is imported, with the glibc tunable `glibc.malloc.hugetlb=1`
  (glibc 2.35+), which asks for transparent huge pages on such mappings: a
  fault brings in 2 MiB (`restart_with_hugepages`). glibc reads tunables only
  at start-up, hence the restart; without the tuning there is none
  (`dpax.__main__`).
- A library cannot restart its user's process: a Python script whose steps
  have large temporaries can call `tune_malloc()` first thing (no mmap for
  large blocks, the heap's top kept up to 1 GiB when freed), or export the
  tunable itself. Not the default: it costs steps with small temporaries on
  many devices time, and the process keeps up to 1 GiB it freed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping

HUGETLB = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# mallopt's parameters (malloc.h) and the values tune_malloc gives them.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREED = 1 << 30
_DETECT = object()  # look at this machine (tests pass the answers instead)


def _thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), if any."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


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


def wants_hugepages(environ: Mapping[str, str] = os.environ, thp_mode=_DETECT,
                    glibc=_DETECT, installed=_DETECT) -> bool:
    """True where setting the tunable would change something: JAX computes on
    the CPU, Linux glibc 2.35+, huge pages given only on request ("madvise";
    "always" already gives them, "never" refuses them), and not set already."""
    if HUGETLB in environ.get("GLIBC_TUNABLES", "").split(":"):
        return False
    if not computes_on_cpu(environ, installed):
        return False
    thp_mode = _thp_mode() if thp_mode is _DETECT else thp_mode
    glibc = _glibc_version() if glibc is _DETECT else glibc
    return sys.platform.startswith("linux") and glibc is not None and glibc >= (2, 35) \
        and thp_mode == "madvise"


def hugepages_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` with the tunable added to any the user already set."""
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    return {**environ, "GLIBC_TUNABLES": ":".join(tunables + [HUGETLB])}


def restart_with_hugepages() -> None:
    """Replace this process by the same command with the tunable set, where it
    helps (`wants_hugepages`); returns only when it does not restart. Call it
    first thing: the new process starts from scratch, and nothing from this
    one (threads, open files aside from stdio) carries over."""
    if not wants_hugepages():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv is the command line as given: a console script's path or `-m dpax`.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], hugepages_env())


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
