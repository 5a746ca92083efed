"""One pytest process with 8 simulated CPU devices covers N = 1, 2, 4, 8 through
device subsets. This must run before anything creates the JAX backend.

Compiled steps go to a persistent XLA cache made for this session: the `dpax`
processes the tests start (README commands, launches, kill -9 and resume)
compile the same steps again and again, and a cache hit replaces a compile
with a file read. Numbers do not change: the cache holds XLA's own executables,
keyed by the program and its options.
"""

import os
import tempfile

import jax

import dpax

_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="dpax-test-xla-cache-"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(_CACHE)  # for the subprocesses
jax.config.update("jax_compilation_cache_dir", _CACHE["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

dpax.simulate_devices(8)
