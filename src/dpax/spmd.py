"""`spmd`: the seeds' `pmap` idiom, on either backend, for any function.

Arguments mapped with `in_axes` 0 carry a leading device axis; `None` ones are
broadcast to every device. Collectives use the axis name `"data"`. Unlike
`jax.pmap(f, in_axes=None)` on current JAX, a call with nothing mapped works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dpax.backends import DEFAULT_BACKEND
from dpax.devices import select_devices
from dpax.errors import DpaxError
from dpax.layout import AXIS


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
