"""glibc's allocator for XLA:CPU steps with large temporaries: the `dpax`
command restarts itself once with the huge-page tunable when the XLA:CPU
tuning is asked for (and only where it changes something); `tune_malloc()` is
the opt-in for Python scripts."""

import os
import subprocess
import sys

import pytest

from dpax.parallel import platform
from dpax.xla_cpu import hostenv
from dpax.xla_cpu.hostenv import HUGETLB, hugepages_env, wants_hugepages

pytestmark = pytest.mark.tuned  # the opt-in tuning: make test-tuned


@pytest.mark.parametrize("environ, thp, glibc, expected", [
    ({}, "madvise", (2, 36), True),
    ({"GLIBC_TUNABLES": HUGETLB}, "madvise", (2, 36), False),  # already restarted
    ({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGETLB}"}, "madvise", (2, 36), False),
    ({}, "always", (2, 36), False),  # the kernel gives huge pages unasked
    ({}, "never", (2, 36), False),  # ... or never
    ({}, None, (2, 36), False),  # no THP at all
    ({}, "madvise", (2, 34), False),  # glibc before the tunable
    ({}, "madvise", None, False),  # not glibc (musl, macOS)
])
def test_wants_hugepages_only_where_it_changes_something(environ, thp, glibc, expected):
    on_linux = sys.platform.startswith("linux")
    assert wants_hugepages(environ, thp, glibc, installed=[]) == (expected and on_linux)


def test_hugepages_env_keeps_the_users_tunables():
    env = hugepages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGETLB}", "HOME": "/h"}
    assert hugepages_env({})["GLIBC_TUNABLES"] == HUGETLB


# The command's first step, as `dpax ARGS` runs it: prints the tunables the
# process ends up with (after a restart, the restarted one's).
_PREPARE = ("import os, sys; from dpax import __main__ as m; from dpax.parallel import platform; "
            "m.asks_for_tuning(sys.argv[1:]) and platform.restart_for_tuning(); "
            "print(os.environ.get('GLIBC_TUNABLES'))")


@pytest.mark.parametrize("argv, environ, asked", [
    ([], {}, False),  # the default: the generic path, no restart
    (["--xla-cpu-tuning"], {}, True),
    ([], {platform.ENV: "1"}, True),
    (["--no-xla-cpu-tuning"], {platform.ENV: "1"}, False),  # the flag wins
    (["--xla-cpu-tuning", "--no-xla-cpu-tuning"], {}, False),  # the last flag wins
    ([], {platform.ENV: "yes"}, False),  # a bad value: the command reports it
])
def test_only_a_command_line_that_asks_for_the_tuning_restarts(argv, environ, asked):
    from dpax.__main__ import asks_for_tuning

    assert asks_for_tuning(argv, environ) == asked


def test_a_config_file_that_took_the_tuning_restarts_unless_a_flag_says_otherwise(tmp_path):
    from dpax.__main__ import asks_for_tuning

    tuned, untuned, broken = (tmp_path / n for n in ("tuned.yaml", "untuned.yaml", "bad.yaml"))
    tuned.write_text("trainer:\n  xla_cpu_tuning: true\n")
    untuned.write_text("trainer:\n  xla_cpu_tuning: false\n")
    broken.write_text("trainer: [\n")
    on = {platform.ENV: "1"}
    assert asks_for_tuning(["--config", str(tuned)], {})
    assert asks_for_tuning([f"--config={tuned}"], {})
    assert not asks_for_tuning(["--config", str(tuned), "--no-xla-cpu-tuning"], {})
    assert not asks_for_tuning(["--config", str(untuned)], on)  # the file's choice wins
    assert asks_for_tuning(["--config", str(broken)], on)  # left to the command to report
    assert not asks_for_tuning(["--config", str(tmp_path / "missing.yaml")], {})


def test_the_command_restarts_with_the_tunable_when_the_tuning_is_asked_for():
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GLIBC_TUNABLES", platform.ENV)}
    if not wants_hugepages(clean):
        pytest.skip("this machine gains nothing from the tunable, so dpax never restarts")

    def tunables(*argv, **env):
        done = subprocess.run([sys.executable, "-c", _PREPARE, *argv], env={**clean, **env},
                              capture_output=True, text=True, timeout=120, check=True)
        return done.stdout.splitlines()

    # One line: the first process printed nothing before exec replaced it, and
    # the restarted one, seeing the tunable, did not restart again.
    assert tunables("--xla-cpu-tuning", "--steps", "5") == [HUGETLB]
    assert tunables(**{platform.ENV: "1"}) == [HUGETLB]
    assert tunables("--steps", "5") == ["None"]


def test_only_the_command_line_restarts_never_a_caller_of_main(monkeypatch):
    calls = []
    monkeypatch.setattr(platform, "restart_for_tuning", lambda: calls.append(True))
    from dpax.__main__ import main as command
    from dpax.cli import main

    bad = ["train", "--steps", "0", "--xla-cpu-tuning"]  # refused before it computes
    assert main(bad) == 2 and calls == []
    monkeypatch.setenv(platform.ENV, "1")
    monkeypatch.setattr(sys, "argv", ["dpax", "devices"])
    assert command() == 0 and calls == []  # devices computes nothing
    monkeypatch.delenv(platform.ENV)
    monkeypatch.setattr(sys, "argv", ["dpax", "train", "--steps", "0"])
    assert command() == 2 and calls == []  # not asked for
    monkeypatch.setattr(sys, "argv", ["dpax", *bad])
    assert command() == 2 and calls == [True]


def test_the_restart_comes_before_jax_is_imported():
    code = ("import sys; import dpax.parallel.platform as p; "
            "p.restart_for_tuning = lambda: print('jax' in sys.modules); "
            "sys.argv = ['dpax', 'train', '--steps', '0', '--xla-cpu-tuning']; "
            "from dpax.__main__ import main; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.splitlines()[:1] == ["False"], done.stderr


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
