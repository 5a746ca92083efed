"""Device arrays and the host: typed PRNG keys, replicas along a leading
device axis (`jax.pmap`'s layout), one replica's copy, whether arrays are
finite (one scalar back from the devices)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpax.parallel import watchdog


def is_key(x: Any) -> bool:
    """A typed PRNG key array (numpy cannot hold these)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def host_leaf(x: Any) -> Any:
    """This process's first-device copy of a replicated array, on the host; a
    typed PRNG key stays a key (rebuilt from its data)."""
    local = x.addressable_data(0) if isinstance(x, jax.Array) else x
    if is_key(local):
        return jax.random.wrap_key_data(np.asarray(jax.random.key_data(local)),
                                        impl=jax.random.key_impl(local))
    return np.asarray(local)


def replicate(tree: Any, n: int) -> Any:
    """Stack `n` copies of every leaf along a new leading axis (pmap layout), on
    the host. `jax.pmap(f, in_axes=None)` with nothing mapped fails on current
    JAX; this is what broadcasting with pmap was for."""
    def stack(x):
        if is_key(x):  # typed PRNG keys: stack their data, then wrap it again
            data = np.asarray(jax.random.key_data(x))
            return jax.random.wrap_key_data(np.broadcast_to(data, (n,) + data.shape),
                                            impl=jax.random.key_impl(x))
        return np.broadcast_to(np.asarray(x), (n,) + np.shape(x))

    return jax.tree.map(stack, tree)


def _first(x: Any) -> Any:
    # The local copy on this process's first device; `x[0]` on a global array
    # would gather across hosts.
    return host_leaf(x)[0]


def unreplicate(tree: Any) -> Any:
    """One host copy of a tree stacked along a leading replica axis."""
    return jax.tree.map(_first, tree)


@jax.jit
def _finite(arrays: list) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(a).all() for a in arrays]))


def all_finite(tree: Any, step: int | None = None) -> bool:
    """Whether every floating-point array of `tree` is finite: one reduction
    on the devices for device arrays, one scalar back (every process gets
    the same answer, so all of them act alike), numpy for host ones.

    Reading the answer waits on every process: the arrays may be split over
    them. A peer that stopped hangs it, so the watchdog times that read
    (at `step`); the compile (the first call's only) stays outside the timer."""
    floats = [v for v in jax.tree.leaves(tree) if jnp.issubdtype(v.dtype, jnp.inexact)]
    on_device = [v for v in floats if isinstance(v, jax.Array)]
    on_host = [v for v in floats if not isinstance(v, jax.Array)]
    if not all(np.isfinite(v).all() for v in on_host):
        return False
    if not on_device:
        return True
    check = _finite.lower(on_device).compile()  # cached by JAX after the first call
    with watchdog.waiting(step):
        return bool(check(on_device))  # sync point: one scalar
