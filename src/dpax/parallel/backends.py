"""Two ways to run one per-device function on N devices, with the same numbers.

`shard_map` (jit + shard_map over a 1-D `data` mesh) is the path JAX recommends
and the one that spans hosts; `pmap` keeps the API `jax.pmap` users know.
Each backend owns its layouts: where state and batches live, and how results
come back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpax.errors import DpaxError
from dpax.parallel import watchdog
from dpax.parallel.arrays import host_leaf, is_key, replicate, unreplicate
from dpax.parallel.mesh import AXIS, REPLICAS, device_axes
from dpax.parallel.platform import Platform

BACKENDS = ("shard_map", "pmap")
DEFAULT_BACKEND = "shard_map"


class Backend(Protocol):
    """What training asks of a backend (`dpax.training`): where the state and
    batches live, the per-device function wrapped and compiled, and results
    back on the host. The step functions take `state_spec`, a PartitionSpec
    per state leaf (None: replicated), which only a backend that can hold a
    split state uses."""

    name: str
    devices: list[jax.Device]
    n: int
    platform: Platform
    replicas: int  # hybrid sharding's groups (1: none)
    axis: Any  # the mesh axes spanning every device (`dpax.parallel.mesh.device_axes`)
    mesh: Mesh  # the devices along `AXIS`, in `replicas` groups along `REPLICAS`

    # -- placing: the state, a step's batch, K steps' batches ---------------------------
    def put_state(self, state: Any, specs: Any = None) -> Any:
        """The state on the devices: replicated, or laid out by `specs`."""

    def local_rows(self, size: int) -> tuple[int, int]:
        """The rows [lo, hi) of a padded global batch of `size` this process holds."""

    def step_input(self, batch: dict, size: int | None = None) -> dict:
        """This process's rows of a padded global batch as the step takes them."""

    def put_batches(self, batches: list[dict], size: int) -> dict:
        """K host batches as the input of a K-steps-per-call step."""

    # -- wrapping and compiling per-device functions ----------------------------------
    def per_device(self, fn: Callable, in_specs, out_specs, check: bool = False) -> Callable:
        """`fn` mapped over the devices (not compiled), for a step that maps
        its own per-device part (`global_stepper`)."""

    def stepper(self, fn: Callable, state_spec=None, with_data: bool = False) -> Callable:
        """`fn(state, metric sums, shard) -> (state, metric sums)`, per device, compiled."""

    def multi_stepper(self, fn: Callable, state_spec=None, with_data: bool = False) -> Callable:
        """As `stepper`, batches stacked along a leading step axis."""

    def global_stepper(self, fn: Callable, state_spec, steps_axis: bool = False,
                       with_data: bool = False) -> Callable:
        """`fn(state, metric sums, batch)` of the whole stored state, compiled."""

    def reduce(self, fn: Callable, state_spec=None) -> Callable:
        """`fn(state, shard) -> replicated result`, per device, compiled."""

    def per_example(self, fn: Callable, state_spec=None) -> Callable:
        """`fn(state, shard) -> one output per example of the shard`, per device, compiled."""

    # -- results back -----------------------------------------------------------------
    def host(self, tree: Any) -> Any:
        """Host copy of replicated outputs (a sync point)."""

    def local(self, tree: Any) -> Any:
        """One device's copy of replicated outputs, left on it (no sync)."""

    def logical(self, state: Any) -> Any:
        """One device-count-independent copy of the state."""

    def host_examples(self, tree: Any) -> Any:
        """Host copy of per-example outputs, in global batch order (a sync point)."""


def check_backend(name: str, processes: int) -> None:
    """The one place the backend rules live (checked before devices start)."""
    if name not in BACKENDS:
        raise DpaxError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "pmap" and processes > 1:
        raise DpaxError("the pmap backend is single-process only in dpax; "
                        "use `backend=shard_map` for several processes")


def _global(x: Any, sharding: NamedSharding) -> jax.Array:
    """A global array from a value every process holds in full (or the array
    itself, when it is one already laid out by `sharding`)."""
    if is_key(x):  # typed PRNG keys: place the raw data, wrap it on the devices
        data = _global(np.asarray(jax.random.key_data(x)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x  # already placed: a checkpoint's leaf, read onto the devices as split
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _batch_spec(rows: P, with_data: bool) -> Any:
    """The layout of a step's batch argument: its rows split, or with
    `with_data` a pair (examples, batch of their indices), the examples
    replicated (a PartitionSpec prefix of the pair)."""
    return (P(), rows) if with_data else rows


class ShardMapBackend:
    """State replicated as one logical array; batches split along their rows.

    With `replicas` > 1 the devices form a 2-D mesh, `replicas` groups of
    consecutive devices (one per process when each process brings one
    group): a split state lies along `AXIS` inside each group."""

    name = "shard_map"

    def __init__(self, devices: Sequence[jax.Device], platform: Platform, replicas: int = 1):
        self.devices = list(devices)
        self.n = len(self.devices)
        self.platform = platform
        self.replicas = replicas
        self.axis = device_axes(replicas)
        if replicas == 1:
            self.mesh = Mesh(np.array(self.devices), (AXIS,))
        else:
            self.mesh = Mesh(np.array(self.devices).reshape(replicas, -1), (REPLICAS, AXIS))
        self._replicated = NamedSharding(self.mesh, P())
        self._rows = NamedSharding(self.mesh, P(self.axis))

    def put_state(self, state: Any, specs: Any = None) -> Any:
        """Replicated, or laid out by `specs` (a PartitionSpec tree prefix)."""
        shardings = self._replicated if specs is None else self._shardings(specs)
        if jax.process_count() == 1:
            return jax.device_put(state, shardings)
        # Several processes: device_put cannot reach other hosts' devices; every
        # process builds its own shards from the same host value.
        if specs is None:
            return jax.tree.map(lambda x: _global(x, self._replicated), state)
        # `shardings` is a prefix of `state`: one sharding per subtree.
        return jax.tree.map(lambda sh, sub: jax.tree.map(lambda x: _global(x, sh), sub),
                            shardings, state, is_leaf=lambda x: isinstance(x, NamedSharding))

    def local_rows(self, size: int) -> tuple[int, int]:
        """The rows [lo, hi) of a padded global batch of `size` that this
        process's devices hold; the whole batch when there is one process."""
        index_map = self._rows.addressable_devices_indices_map((size,))
        spans = [idx[0].indices(size)[:2] for idx in index_map.values()]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if hi - lo != sum(b - a for a, b in spans):
            raise DpaxError("this process's devices are not contiguous in the mesh")
        return lo, hi

    def step_input(self, batch: dict, size: int | None = None) -> dict:
        """This process's rows of a padded global batch of `size` rows, as the
        compiled step takes them: one global array split over every process's
        devices, or with one process the host arrays themselves."""
        if jax.process_count() == 1:
            # Host arrays go straight into the compiled step, whose in_shardings
            # split them over the devices: jit's own transfer path is cheaper
            # than a device_put first.
            return batch

        def put(v):
            shape = ((size or len(v)),) + v.shape[1:]
            return jax.make_array_from_process_local_data(self._rows, v, shape)

        return jax.tree.map(put, batch)

    def put_batches(self, batches: list[dict], size: int) -> dict:
        """K host batches -> one array per key of shape (K, size, ...), rows split
        over devices: the input of a K-steps-per-call step."""
        sharding = NamedSharding(self.mesh, P(None, self.axis))
        if jax.process_count() == 1:
            return jax.tree.map(lambda *vs: np.stack(vs), *batches)

        def put(*vs):
            local = np.stack(vs)
            shape = (len(vs), size) + local.shape[2:]
            return jax.make_array_from_process_local_data(sharding, local, shape)

        return jax.tree.map(put, *batches)

    def per_device(self, fn: Callable, in_specs, out_specs, check: bool = False) -> Callable:
        """`fn` mapped over the mesh (shard_map): each device runs it on its part."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check)

    def _compile(self, fn: Callable, in_specs: tuple, donate: bool,
                 out_specs=None) -> Callable:
        """`fn` under jit, its inputs (and, with `out_specs`, its outputs) laid
        out by PartitionSpecs over the mesh; the first argument donated."""
        out = None if out_specs is None else self._shardings(out_specs)
        return self.platform.compile(
            lambda options: jax.jit(fn, in_shardings=self._shardings(in_specs),
                                    out_shardings=out, donate_argnums=(0,) if donate else (),
                                    compiler_options=options))

    def _wrap(self, fn: Callable, out_specs, donate: bool, batch_spec=None,
              state_spec=None, carries_metrics: bool = False) -> Callable:
        """`fn(state, [metrics,] batch)` run per device: the optional middle
        argument is the replicated running metric sums of a training step (not
        donated: the host waits on earlier ones to bound the steps in flight)."""
        batch_spec = P(self.axis) if batch_spec is None else batch_spec
        # A sharded state (`dpax.parallel.layout`) rebuilds the params with all_gather, whose result
        # JAX 0.10 cannot type as replicated; the check is off for that step only,
        # as it is in pmap. The step's own pcast/psum are explicit either way. On
        # one device it is off too, so that the step's all-reduces can be left out
        # (`psum_packed`): XLA keeps a one-device all-reduce as a kernel launch.
        check = state_spec is None and self.n > 1
        state_spec = P() if state_spec is None else state_spec
        in_specs = (state_spec, *((P(),) if carries_metrics else ()), batch_spec)
        return self._compile(self.per_device(fn, in_specs, out_specs, check), in_specs, donate)

    def _shardings(self, specs: Any) -> Any:
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def stepper(self, fn: Callable, state_spec=None, with_data: bool = False) -> Callable:
        """`fn(state, metric sums, shard) -> (state, metric sums)`, per device;
        `state_spec` lays out a state that is not fully replicated. `with_data`:
        the shard is `(data, rows)`, the examples replicated and a batch of
        their indices split (`dpax.data.batches.gather_rows`)."""
        out_state = P() if state_spec is None else state_spec
        return self._wrap(fn, (out_state, P()), donate=True,
                          batch_spec=_batch_spec(P(self.axis), with_data),
                          state_spec=state_spec, carries_metrics=True)

    def multi_stepper(self, fn: Callable, state_spec=None, with_data: bool = False) -> Callable:
        """`fn(state, metric sums, batches)`, batches stacked along a leading step axis."""
        out_state = P() if state_spec is None else state_spec
        return self._wrap(fn, (out_state, P()), donate=True,
                          batch_spec=_batch_spec(P(None, self.axis), with_data),
                          state_spec=state_spec, carries_metrics=True)

    def global_stepper(self, fn: Callable, state_spec, steps_axis: bool = False,
                       with_data: bool = False) -> Callable:
        """`fn(state, metric sums, batch) -> (state, metric sums)` of the whole
        stored state and batch, under jit (it maps its own per-device part);
        `steps_axis`: batches stacked along a leading step axis."""
        batch_spec = _batch_spec(P(None, self.axis) if steps_axis else P(self.axis),
                                 with_data)
        return self._compile(fn, (state_spec, P(), batch_spec), donate=True,
                             out_specs=(state_spec, P()))

    def reduce(self, fn: Callable, state_spec=None) -> Callable:
        """`fn(state, shard) -> replicated result`, per device."""
        return self._wrap(fn, P(), donate=False, state_spec=state_spec)

    def per_example(self, fn: Callable, state_spec=None) -> Callable:
        """`fn(state, shard) -> one output per example of the shard`, per device."""
        return self._wrap(fn, P(self.axis), donate=False, state_spec=state_spec)

    def host(self, tree: Any) -> Any:
        """Host copy of replicated outputs. A device-to-host transfer: a sync
        point, which waits on every process that computes them (timed)."""
        with watchdog.waiting():
            return jax.tree.map(host_leaf, tree)

    def local(self, tree: Any) -> Any:
        """This process's first-device copy of replicated outputs, left on that
        device: no transfer to the host, so no sync (host arrays pass through)."""
        return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x,
                            tree)

    def logical(self, state: Any) -> Any:
        """One device-count-independent copy of the state: the replicated global
        arrays themselves (Orbax writes one copy, from process 0's devices)."""
        return state

    def host_examples(self, tree: Any) -> Any:
        """Host copy of per-example outputs, every process's rows in global batch
        order (sync point; a gather across processes when there are several)."""
        if jax.process_count() == 1:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)


_WHOLE_ONLY = ("the pmap backend holds the whole state on each device; a split layout "
               "needs `backend=shard_map`")


class PmapBackend:
    """`jax.pmap`'s layout: a leading device axis on state and batches."""

    name = "pmap"
    replicas = 1
    axis = AXIS

    def __init__(self, devices: Sequence[jax.Device], platform: Platform, replicas: int = 1):
        check_backend(self.name, jax.process_count())
        if replicas != 1:
            raise DpaxError(_WHOLE_ONLY)
        self.devices = list(devices)
        self.n = len(self.devices)
        self.platform = platform  # jax.pmap takes no compile options
        # pmap on current JAX is jit + shard_map over exactly this mesh, so
        # placing inputs with its sharding means pmap never copies them again.
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self._stacked = NamedSharding(self.mesh, P(AXIS))

    def put_state(self, state: Any, specs: Any = None) -> Any:
        return jax.device_put(replicate(state, self.n), self._stacked)

    def local_rows(self, size: int) -> tuple[int, int]:
        return 0, size

    def step_input(self, batch: dict, size: int | None = None) -> dict:
        # Host arrays with a leading device axis: pmap splits them on its own
        # transfer path, cheaper than a device_put first (as for shard_map).
        return jax.tree.map(lambda v: v.reshape((self.n, -1) + v.shape[1:]), batch)

    def put_batches(self, batches: list[dict], size: int) -> dict:
        """K host batches -> (n, K, size / n, ...) per key: device axis first."""
        def put(*vs):
            x = np.stack(vs)  # (K, size, ...)
            return x.reshape((len(vs), self.n, -1) + x.shape[2:]).swapaxes(0, 1)

        return jax.tree.map(put, *batches)

    def _wrap(self, fn: Callable, donate: bool) -> Callable:
        return jax.pmap(
            fn, axis_name=AXIS, devices=self.devices, donate_argnums=(0,) if donate else ()
        )

    # No state_spec: `layout` allows none with pmap. `with_data` needs no
    # layout of its own: examples placed by `put_state` carry a device axis.
    def stepper(self, fn: Callable, state_spec=None, with_data: bool = False) -> Callable:
        return self._wrap(fn, donate=True)

    def multi_stepper(self, fn: Callable, state_spec=None, with_data: bool = False) -> Callable:
        return self._wrap(fn, donate=True)

    def reduce(self, fn: Callable, state_spec=None) -> Callable:
        return self._wrap(fn, donate=False)

    # A split state's step: pmap places every array whole on each device, so
    # only a layout that keeps the state whole runs on it (`check_sharding`
    # refuses the others before a Trainer starts).
    def per_device(self, fn: Callable, in_specs, out_specs, check: bool = False) -> Callable:
        raise DpaxError(_WHOLE_ONLY)

    def global_stepper(self, fn: Callable, state_spec, steps_axis: bool = False,
                       with_data: bool = False) -> Callable:
        raise DpaxError(_WHOLE_ONLY)

    def per_example(self, fn: Callable, state_spec=None) -> Callable:
        return self._wrap(fn, donate=False)

    def host(self, tree: Any) -> Any:
        """Replica 0's host copy (sync point)."""
        return unreplicate(tree)

    def local(self, tree: Any) -> Any:
        """Replica 0's copy, left on its device (no sync; host arrays pass through)."""
        return jax.tree.map(lambda x: x.addressable_data(0)[0] if isinstance(x, jax.Array)
                            else x, tree)

    def logical(self, state: Any) -> Any:
        """One device-count-independent copy of the state (host arrays)."""
        return unreplicate(state)

    def host_examples(self, tree: Any) -> Any:
        """Per-example outputs with the device axis merged back (sync point)."""
        return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), tree)


def make_backend(name: str, devices: Sequence[jax.Device], platform: Platform,
                 replicas: int = 1) -> Backend:
    """The backend `name` on `devices`, in `replicas` groups (hybrid sharding)."""
    check_backend(name, jax.process_count())
    return {"shard_map": ShardMapBackend, "pmap": PmapBackend}[name](devices, platform,
                                                                      replicas)
