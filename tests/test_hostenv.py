"""`dpax.xla_cpu.hostenv.tune_malloc()`, the opt-in allocator setting for
XLA:CPU steps with large temporaries, and where it applies."""

import os
import subprocess
import sys

import pytest

from dpax.xla_cpu import hostenv


@pytest.mark.parametrize("environ, installed, expected", [
    ({}, [], True),
    ({}, ["jax_plugins"], False),  # a CUDA or ROCm plugin: steps run on the GPU
    ({}, ["libtpu"], False),
    ({"JAX_PLATFORMS": "cpu"}, ["jax_plugins"], True),  # the user chose the CPU
    ({"JAX_PLATFORMS": "cuda,cpu"}, [], False),
])
def test_the_setting_is_only_for_xla_cpu(environ, installed, expected):
    assert hostenv.computes_on_cpu(environ, installed) == expected


# Allocates and frees a 64 MiB block three times, touching every page, after
# `tune_malloc()` when argv[1] says so; prints the page faults of the last round.
_FAULTS = """
import ctypes, resource, sys
from dpax.xla_cpu.hostenv import tune_malloc
if sys.argv[1] == "tune":
    assert tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_tune_malloc_makes_a_freed_large_block_reusable_without_faults():
    """What XLA:CPU does every step with its temporaries: untuned, glibc maps a
    block this large afresh each time and the kernel faults in every page;
    tuned, the heap keeps the pages."""
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if not (hostenv.computes_on_cpu(clean) and hostenv._glibc_version()):
        pytest.skip("no glibc here, or JAX computes on an accelerator")

    def faults(mode):
        done = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=clean,
                              capture_output=True, text=True, timeout=120, check=True)
        return int(done.stdout.split()[-1])

    untuned = faults("plain")
    if untuned < 1000:
        pytest.skip("this kernel backs fresh mappings with huge pages: nothing to save")
    assert faults("tune") < untuned / 20
