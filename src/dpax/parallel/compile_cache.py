"""JAX's persistent compilation cache, on by default: compiled programs kept
on disk, so that a second run, a `--resume` or a restarted process reads
what an earlier one compiled instead of compiling it again.

A program read back is the executable an earlier run compiled, so a warm run
repeats that run's numbers. JAX's key for an entry covers the program, the
compile options (the XLA:CPU tuning's choices among them), the XLA flags and
the platform, but not the processor's instruction set: dpax's default
directory adds the machine (`dpax.machine`), so that a home shared by hosts
of different processors never hands one host code compiled for another.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache

from dpax.errors import DpaxError, DpaxWarning
from dpax.machine import cache_dir, machine_key

DEFAULT = "default"  # JAX's own setting if the user made one, else `default_dir()`
OFF = "none"
# In a directory dpax is given or picks: programs that compile in at least
# this long (a model's initialization compiles dozens of them, the larger
# ones read back faster than they compile) ...
MIN_COMPILE_SECS = 0.1
# ... and at most this many bytes of them, the least recently read going first.
MAX_BYTES = 4 << 30

# Whether the cache is off because dpax turned it off (`OFF`), not the user:
# a later `DEFAULT` turns it on again. And the default directories already
# warned about (the CLI and then its Trainer both ask).
_off_by_dpax = False
_warned: set[str] = set()


def default_dir(device: jax.Device) -> str:
    """The per-user, per-machine directory: `xla/` and a hash of `device`'s
    machine, under `DPAX_CACHE_DIR` (default $XDG_CACHE_HOME/dpax or ~/.cache/dpax)."""
    key = hashlib.sha256(machine_key(device).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "xla", key)


def use(setting: str | None = DEFAULT, device: jax.Device | None = None) -> str | None:
    """Point JAX's persistent compilation cache at `setting`, for the whole
    process, and return the directory in use (None: none).

    Args:
      setting: `DEFAULT` (what the user set JAX to, through
        `JAX_COMPILATION_CACHE_DIR` / `JAX_ENABLE_COMPILATION_CACHE` or
        `jax.config`; else `default_dir`, or no cache with a warning where
        that cannot be written), a directory, or `OFF` / None for none.
      device: a device of the run (the machine the default directory names);
        None: the first local device.

    Raises:
      DpaxError: a directory given here cannot be made or written.
    """
    global _off_by_dpax
    config = jax.config
    if setting is None or setting == OFF:
        _set(jax_enable_compilation_cache=False)
        _off_by_dpax = True
        return None
    if setting == DEFAULT:
        if not config.jax_enable_compilation_cache and not _off_by_dpax:
            return None  # the user turned JAX's cache off
        _off_by_dpax = False
        if config.jax_compilation_cache_dir:
            _set(jax_enable_compilation_cache=True)
            return config.jax_compilation_cache_dir
        path = default_dir(device or jax.local_devices()[0])
        problem = _unwritable(path)
        if problem:
            if path not in _warned:
                _warned.add(path)
                warnings.warn(f"no compilation cache: {path} cannot be written ({problem}); "
                              "give `compile_cache` a writable directory", DpaxWarning,
                              stacklevel=3)
            return None
    else:
        _off_by_dpax = False
        path = os.path.abspath(os.path.expanduser(setting))
        if path == config.jax_compilation_cache_dir:
            _set(jax_enable_compilation_cache=True)
            return path
        problem = _unwritable(path)
        if problem:
            raise DpaxError(f"the compilation cache directory {path} cannot be written "
                            f"({problem}): give `compile_cache` a writable directory, "
                            f"or '{OFF}'")
    _set(jax_enable_compilation_cache=True, jax_compilation_cache_dir=path,
         jax_persistent_cache_min_compile_time_secs=MIN_COMPILE_SECS,
         jax_compilation_cache_max_size=MAX_BYTES)
    return path


@contextlib.contextmanager
def off():
    """No cache inside, whatever a Trainer made there asks (e.g. to time
    compilations); the settings as they were after."""
    global _off_by_dpax
    was, was_ours = jax.config.jax_enable_compilation_cache, _off_by_dpax
    _set(jax_enable_compilation_cache=False)
    _off_by_dpax = False  # as if the user had: `DEFAULT` keeps it off
    try:
        yield
    finally:
        _set(jax_enable_compilation_cache=was)
        _off_by_dpax = was_ours


def _set(**settings) -> None:
    """Update JAX's settings; JAX decides once per process whether and where
    its cache is, so a change makes it decide again."""
    changed = {k: v for k, v in settings.items() if getattr(jax.config, k) != v}
    for name, value in changed.items():
        jax.config.update(name, value)
    if changed:
        compilation_cache.reset_cache()


def _unwritable(path: str) -> str | None:
    """Why `path` cannot hold the cache, or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "it is a file"
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".dpax-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None
