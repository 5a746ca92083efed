"""Process settings that only take effect when a process starts (XLA:CPU only).

XLA:CPU allocates each step's temporaries with one malloc and frees them
after the step. glibc serves an allocation that large from a fresh mmap, so
the kernel faults it in and zeroes it 4 KiB at a time on every step, which
costs a large share of a conv step's CPU time (benchmarks/README.md has the
numbers). With the glibc tunable `glibc.malloc.hugetlb=1` (glibc 2.35+)
malloc asks for transparent huge pages on such mappings, and a fault brings
in 2 MiB.

glibc reads tunables once, at start-up, so the `dpax` command restarts itself
with the tunable set (`restart_with_hugepages`, before JAX is imported), but
only where JAX will compute on the CPU: an accelerator's steps do not run
through malloc.

A library cannot restart its user's process. Since dpax rewrites max
pooling's gradient (`dpax.xla_cpu.backward`), its steps' temporaries mostly stay
under 32 MiB per device, which glibc serves from its heap by itself after the
first step, and the tunable no longer changes their speed (benchmarks/README.md,
"Host allocator"). A step with more (the cnn at batch 128 on one device: 46
MiB) still faults its temporaries in every step; a Python script can call
`tune_malloc()` first thing instead of exporting the tunable: no mmap for
large blocks, and the heap's top kept up to 1 GiB when freed. Not the default:
it costs steps with small temporaries on many devices up to 14%, and the
process keeps up to 1 GiB it freed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping

HUGETLB = "glibc.malloc.hugetlb=1"
OPT_OUT = "DPAX_NO_RESTART"  # set to anything: never restart the process
# mallopt's parameters (malloc.h) and the values tune_malloc gives them.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREED = 1 << 30
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
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
    "always" already gives them, "never" refuses them), and not set already or
    opted out of."""
    if environ.get(OPT_OUT) or HUGETLB in environ.get("GLIBC_TUNABLES", "").split(":"):
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
