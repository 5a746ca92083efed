"""`jax.pmap`'s idioms on current JAX, for code written the pmap way:
`spmd(fn)`, a function mapped over a leading device axis on either backend,
and the helpers for that axis (`shard_batch`, `unshard`, `replicate`,
`unreplicate`, `replicas_in_sync`). The Trainer needs none of them: it lays
out its state and places its batches itself.

Arguments mapped with `in_axes` 0 carry a leading device axis; `None` ones are
broadcast to every device. Collectives use the axis name `"data"`. Unlike
`jax.pmap(f, in_axes=None)` on current JAX, a call with nothing mapped works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dpax.data.batches import Batch, batch_rows, pad_batch, padded_size
from dpax.errors import DpaxError
from dpax.parallel.arrays import is_key, replicate, unreplicate
from dpax.parallel.backends import DEFAULT_BACKEND
from dpax.parallel.mesh import AXIS, select_devices

__all__ = ["replicas_in_sync", "replicate", "shard_batch", "spmd", "unreplicate", "unshard"]


def spmd(
    fn: Callable,
    *,
    devices: int | Sequence[jax.Device] | None = None,
    in_axes: int | None | Sequence[int | None] = 0,
    static_argnums: Sequence[int] = (),
    backend: str = DEFAULT_BACKEND,
) -> Callable:
    """Run `fn` once per device, like `jax.pmap(fn, axis_name="data")`.

    Args:
      fn: a function of one device's arguments; may call `jax.lax.psum(x, "data")`.
      devices: a count, a list of devices, or None for all local devices.
      in_axes: per positional argument, 0 (split the leading device axis) or None
        (same value on every device); one value applies to all.
      static_argnums: arguments passed as Python constants (compiled in).
      backend: "shard_map" or "pmap".

    Returns:
      A function whose outputs have a leading device axis, as pmap's do.
    """
    devs = list(devices) if isinstance(devices, (list, tuple)) else select_devices(devices)
    static = tuple(static_argnums)
    if backend == "pmap":
        return _pmap_like(fn, devs, in_axes, static)
    if backend != "shard_map":
        raise DpaxError(f"unknown backend {backend!r}; choose shard_map or pmap")
    mesh = Mesh(np.array(devs), (AXIS,))

    @functools.cache
    def compiled(n_args: int, static_values: tuple) -> Callable:
        axes = in_axes if isinstance(in_axes, (list, tuple)) else [in_axes] * n_args
        dynamic = [i for i in range(n_args) if i not in static]
        if len(axes) != n_args:
            raise DpaxError(f"in_axes has {len(axes)} entries for {n_args} arguments")
        if any(a not in (0, None) for a in axes):
            raise DpaxError("spmd supports in_axes of 0 or None; move the device axis first")

        def per_device(*dyn):
            args = dict(zip(static, static_values))
            for i, x in zip(dynamic, dyn):
                # A mapped argument arrives as a (1, ...) block: drop the device axis.
                args[i] = jax.tree.map(lambda a: a[0], x) if axes[i] == 0 else x
            out = fn(*(args[i] for i in range(n_args)))
            return jax.tree.map(lambda a: a[None], out)

        specs = tuple(P(AXIS) if axes[i] == 0 else P() for i in dynamic)
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(AXIS)))

    def call(*args):
        dyn = [a for i, a in enumerate(args) if i not in static]
        return compiled(len(args), tuple(args[i] for i in static))(*dyn)

    return call


def _pmap_like(fn, devs, in_axes, static):
    axes = in_axes if isinstance(in_axes, (list, tuple)) else in_axes
    return jax.pmap(fn, axis_name=AXIS, in_axes=axes, devices=devs,
                    static_broadcasted_argnums=static)


# -- a leading device axis on the host -------------------------------------------------
def shard_batch(batch: Batch, n: int, size: int | None = None) -> Batch:
    """Pad a global batch to `size` rows (default: next multiple of `n`) and
    reshape every array to `(n, size // n, ...)`, with a boolean `mask`."""
    if not isinstance(batch, dict):  # the mask needs a key of its own
        raise DpaxError(f"`batch` must be a dict of arrays, e.g. {{'x': x, 'y': y}}, got "
                        f"{type(batch).__name__}; shard_batch adds its 'mask' beside them")
    b = batch_rows(batch)
    size = padded_size(b, n) if size is None else size
    if size % n:
        raise ValueError(f"padded size {size} is not a multiple of {n} devices")
    padded = pad_batch(batch, size)
    return jax.tree.map(lambda v: v.reshape((n, size // n) + v.shape[1:]), padded)


def unshard(tree: Any, mask: np.ndarray | None = None) -> Any:
    """Merge the leading device axis back into the batch axis; with `mask`
    (as `shard_batch` made it) keep only the real examples, in order."""
    flat = jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + np.shape(x)[2:]), tree)
    if mask is None:
        return flat
    keep = np.asarray(mask).reshape(-1)
    return jax.tree.map(lambda x: x[keep], flat)


def _replica_bytes(x: Any) -> list[bytes]:
    if is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array):
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        if x.is_fully_replicated:
            return [s.tobytes() for s in shards]
        # pmap layout: each shard is one replica's (1, ...) slice.
        return [r.tobytes() for s in shards for r in s]
    return [r.tobytes() for r in np.asarray(x)]


def replicas_in_sync(tree: Any) -> bool:
    """True when every local replica of every leaf is bit-identical.

    Works on both layouts: replicated `jax.Array`s (shard_map) and arrays
    stacked along a leading replica axis (pmap, or host numpy).
    """
    for leaf in jax.tree.leaves(tree):
        copies = _replica_bytes(leaf)
        if any(c != copies[0] for c in copies[1:]):
            return False
    return True
