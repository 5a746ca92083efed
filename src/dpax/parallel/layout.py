"""How the training state lives on the devices, and where its update runs.

  replicated  every device holds the whole state; the whole step runs per
              device and ends in one all-reduce of the gradients
  optimizer   ZeRO-1: every device holds the params and 1/N of the optimizer
              state; the gradients are reduce-scattered, the update runs on
              1/N of the state, the new params are all-gathered
  full        FSDP (ZeRO-3): params, gradients and optimizer state 1/N per
              device; each param is all-gathered where the model uses it and
              its gradient reduce-scattered as the backward pass produces it

A sharded leaf is split along one of its dimensions (`Split`), zero-padded to
a multiple of N there, so any device count splits any shape.

Hybrid sharding (`replicas` = R > 1): the N devices form R groups of N/R
(`dpax.parallel.mesh`); a sharded layout splits the state over the devices
of a group and replicates it across the groups. A gradient is
reduce-scattered inside each group, then its slice all-reduced across the
groups: the fast links (inside a host) carry the gathers and scatters, the
slow ones (between hosts) 1/(N/R) of the gradient bytes.

The update of a sharded layout runs on the params, gradients and optimizer
state in their logical shapes and tree, outside the per-device function: jit
partitions it over the mesh, and XLA adds whatever collectives the optimizer's
math needs (a global norm, a per-layer trust ratio, a factored moment). So any
optax transformation computes what it computes on one device, and nothing in
the optimizer ever sees the padding.

Checkpoints hold the logical state (`state_dict`): the same for every layout
and device count.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpax.collectives import psum_tree, reduce_scatter
from dpax.errors import DpaxError
from dpax.parallel.arrays import is_key
from dpax.parallel.comms import ACROSS
from dpax.parallel.mesh import AXIS, REPLICAS, device_axes


@dataclasses.dataclass(frozen=True)
class Split:
    """How one state leaf of logical `shape` lives on n devices: split along
    `dim` (None: replicated), zero-padded there to a multiple of n. With
    hybrid sharding the n devices are one group of `replicas`, each holding
    the same slices."""

    shape: tuple[int, ...]
    n: int
    dim: int | None = None
    replicas: int = 1

    @classmethod
    def best(cls, shape: tuple[int, ...], n: int, replicas: int = 1) -> Split:
        """Split along the dimension that needs the least padding (the
        outermost one on a tie): a dimension n divides needs none, and a
        split of the outermost dimension leaves each device one contiguous
        block, which gathers and scatters without reordering."""
        if not shape:
            return cls(shape, n, replicas=replicas)
        padded = [math.prod(shape) // s * _round_up(s, n) for s in shape]
        dim = min(range(len(shape)), key=lambda d: (padded[d], d))
        return cls(tuple(shape), n, dim, replicas)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        d = self.dim
        return self.shape[:d] + (_round_up(self.shape[d], self.n),) + self.shape[d + 1:]

    @property
    def spec(self) -> P:
        if self.dim is None:
            return P()
        return P(*([None] * self.dim), AXIS)

    def pad(self, x):
        """The stored (padded) leaf from a logical one; numpy stays numpy."""
        if self.dim is None or self.padded_shape == self.shape:
            return x
        widths = [(0, 0)] * len(self.shape)
        widths[self.dim] = (0, self.padded_shape[self.dim] - self.shape[self.dim])
        return (np.pad if isinstance(x, np.ndarray) else jnp.pad)(x, widths)

    def unpad(self, x):
        """The logical leaf from a stored one."""
        if self.dim is None or self.padded_shape == self.shape:
            return x
        return x[tuple(slice(0, s) for s in self.shape)]

    # -- in the per-device step: this device's slice along `dim` -----------------
    def gather(self, local: jax.Array) -> jax.Array:
        """The whole logical leaf from every device's slice (a leaf no split
        divides, a scalar, is whole on every device)."""
        if self.dim is None:
            return local
        return self.unpad(jax.lax.all_gather(local, AXIS, axis=self.dim, tiled=True))

    def scatter_sum(self, whole: jax.Array) -> jax.Array:
        """This device's slice of the sum over devices of a logical leaf: over
        its group's devices, then (hybrid sharding) over the groups. A leaf
        that is not split (a scalar) is summed whole."""
        if self.dim is None:
            part = psum_tree(whole, AXIS)
        else:
            part = reduce_scatter(self.pad(whole), AXIS, self.dim)
        return part if self.replicas == 1 else psum_tree(part, REPLICAS)


def _round_up(size: int, n: int) -> int:
    return -(-size // n) * n


class Layout(Protocol):
    """Where each state leaf lives (`splits`, one `Split` per leaf of the
    state) and the few things the step asks of it. The step owns the update.

    A layout is made by its class, `cls(state, n, grad_accum, pack,
    replicas)`, for a logical state on n devices in `replicas` groups
    (`LAYOUTS` names the built-in ones; `replicas` is passed only when it is
    more than 1). What the estimate and the collective count ask (`memory`,
    `least_collectives`, `step_collectives`) needs no state: it is asked of
    the class, `memory` for the devices of one group."""

    name: str
    # The mesh axes spanning every device (`dpax.parallel.mesh.device_axes`):
    # the step's sums over the global batch run over them.
    axis: Any
    # True: every device holds the whole state (each leaf's `Split` has no
    # dim), so any backend can place it, pmap's replicas included.
    whole_state: bool
    # True: the whole step runs per device (the state is one replica);
    # False: the update runs on the logical state under jit (`dpax.training.step`).
    per_device_update: bool
    # True: each param's gradient is reduced as the backward pass produces it
    # (FSDP), so the step hands `reduce` gradients already reduced.
    grads_in_backward: bool
    # True: `reduce` sums each gradient element over the devices whatever the
    # leaf's shape (an all-reduce), so a leaf may be summed in another shape.
    sums_elementwise: bool
    splits: Any
    # One `Split` per param leaf: how each gradient reaches the update (the
    # out_specs of the step's per-device part when the update is not per device).
    grad_splits: Any
    pack: bool  # all-reduce operands packed (`dpax.collectives`)

    def grad_target(self, params, dtypes) -> tuple[Any, Callable]:
        """Per device: (what to differentiate, how the model's params come from it)."""

    def reduce(self, loss_sum, count, sums, grad_sums) -> tuple:
        """Per device: every sum over the devices; the gradients as the update takes them."""

    def full_params(self, params):
        """Per device: the whole params, from this device's part of them."""

    # -- the models the estimate asks of the class (no state needed) -----------------
    @classmethod
    def memory(cls, params, opt_state, n: int, grad_accum: int = 1,
               compute_bytes: int | None = None, ema: bool = False,
               model_bytes: int = 0) -> dict[str, float]:
        """Bytes per device the state takes, by part: "model" (the model as
        built, `model_bytes`, where it stays on a device), "params",
        "optimizer", "gradients" and "update" (the update's temporaries).
        `params`, `opt_state`: trees of arrays or `jax.ShapeDtypeStruct`s;
        `grad_accum`: micro-batches per step; `compute_bytes`: the compute
        dtype's item size (None: as stored); `ema`: an EMA of the params kept."""

    @classmethod
    def least_collectives(cls, grad_bytes: int, param_bytes: int) -> dict[str, int]:
        """Collective kind -> the least logical bytes a step moves, with
        `grad_bytes` of gradients and `param_bytes` of params (`dpax.parallel.comms`)."""

    @classmethod
    def step_collectives(cls, params, n: int, grad_accum: int = 1,
                         compute_bytes: int | None = None,
                         replicas: int = 1) -> dict[str, int]:
        """`least_collectives` of a step of `params` (a tree, as for
        `memory`) on n devices in `replicas` groups, in the shapes and dtypes
        this layout moves them in; nothing on one device. What crosses the
        groups is keyed `ACROSS` + kind."""


def tree_bytes(tree) -> int:
    """Bytes of `tree`'s leaves (arrays or `jax.ShapeDtypeStruct`s)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def split_bytes(tree, n: int) -> int:
    """Bytes of `tree` (arrays or `jax.ShapeDtypeStruct`s) on all n devices
    together when every leaf is split the way the sharded layouts split it
    (`Split.best`: zero-padded to a multiple of N along one dimension)."""
    return sum(math.prod(Split.best(tuple(x.shape), n).padded_shape) *
               jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class Replicated:
    """Every field of the state on every device; one all-reduce per step."""

    name = "replicated"
    axis = AXIS
    whole_state = True
    per_device_update = True
    grads_in_backward = False
    sums_elementwise = True

    def __init__(self, state, n: int = 1, grad_accum: int = 1, pack: bool = False,
                 replicas: int = 1):
        # Every device holds the whole state: groups change nothing, and
        # `dpax.training.trainer` makes none for this layout.
        self.splits = jax.tree.map(lambda x: Split(tuple(np.shape(x)), n), state)
        self.grad_splits = self.splits.params
        self.pack = pack
        self.axis = device_axes(replicas)

    def grad_target(self, params, dtypes):
        # Differentiate this device's own loss sum. Without the cast, shard_map
        # would transpose the replicated params into an implicit psum, and the
        # explicit one in `reduce` would count every gradient N times.
        return jax.lax.pcast(params, self.axis, to="varying"), lambda p: p

    def reduce(self, loss_sum, count, sums, grad_sums):
        # One all-reduce for everything (sums add up exactly across devices),
        # packed into as few buffers as possible.
        loss_sum, count, grad_sums, sums = psum_tree((loss_sum, count, grad_sums, sums),
                                                     self.axis, self.pack)
        return loss_sum, count, sums, grad_sums

    def full_params(self, params):
        return params

    @classmethod
    def memory(cls, params, opt_state, n, grad_accum=1, compute_bytes=None, ema=False,
               model_bytes=0):
        p = tree_bytes(params)
        # The update's temporaries: about one param-sized buffer where it runs.
        # With several micro-batches, one micro-batch's whole gradients besides their sum.
        return {"model": model_bytes, "params": p,
                "optimizer": tree_bytes(opt_state) + (p if ema else 0),
                "gradients": p + p if grad_accum > 1 else p, "update": p}

    @classmethod
    def least_collectives(cls, grad_bytes, param_bytes):
        # Plus a few scalars (loss, count, metric sums) packed into the same all-reduce.
        return {"all-reduce": grad_bytes}

    @classmethod
    def step_collectives(cls, params, n, grad_accum=1, compute_bytes=None, replicas=1):
        p = tree_bytes(params)
        return cls.least_collectives(p, p) if n > 1 else {}


class _Sharded:
    """What ZeRO-1 and FSDP share: split leaves, and gradients reduce-scattered
    along each param's split (`grad_splits`)."""

    axis = AXIS
    whole_state = False
    per_device_update = False
    grads_in_backward = False  # FSDP: reduce-scattered as the backward pass runs
    sums_elementwise = False  # reduce-scattered along each param's split

    def __init__(self, state, n: int, split_params: bool, pack: bool, replicas: int = 1):
        if n % replicas:
            raise DpaxError(f"`replicas={replicas}` does not divide the {n} devices into "
                            "equal groups; use a divisor of the device count")
        self.n = g = n // replicas  # the devices a leaf is split over: one group's
        self.replicas = replicas
        self.axis = device_axes(replicas)
        self.pack = pack
        self.grad_splits = jax.tree.map(lambda x: Split.best(np.shape(x), g, replicas),
                                        state.params)

        def split(x):
            if is_key(x) or not np.ndim(x):
                return Split(tuple(np.shape(x)), g)  # scalars (step counts) stay replicated
            return Split.best(np.shape(x), g, replicas)

        def replicated(tree):
            return jax.tree.map(lambda x: Split(tuple(np.shape(x)), g), tree)

        self.splits = state.replace(
            step=Split((), g), bad_in_a_row=Split((), g), rng=replicated(state.rng),
            model_state=replicated(state.model_state),
            params=self.grad_splits if split_params else replicated(state.params),
            opt_state=jax.tree.map(split, state.opt_state),
            ema=None if state.ema is None else (
                self.grad_splits if split_params else replicated(state.ema)))

    def reduce(self, loss_sum, count, sums, grad_sums):
        if not self.grads_in_backward:
            grad_sums = jax.tree.map(lambda s, g: s.scatter_sum(g), self.grad_splits, grad_sums)
        loss_sum, count, sums = psum_tree((loss_sum, count, sums), self.axis, self.pack)
        return loss_sum, count, sums, grad_sums

    @classmethod
    def least_collectives(cls, grad_bytes, param_bytes):
        # ZeRO-1: the updated params gathered; FSDP: each param where the model uses it.
        return {"reduce-scatter": grad_bytes, "all-gather": param_bytes}

    @classmethod
    def step_collectives(cls, params, n, grad_accum=1, compute_bytes=None, replicas=1):
        g = n // replicas  # a group's devices
        padded = split_bytes(params, g)  # moved in the padded shapes the layout splits
        moved = cls.least_collectives(padded, padded) if g > 1 else {}
        if replicas > 1:  # each device's slice of the gradients, summed across the groups
            moved[ACROSS + "all-reduce"] = padded // g
        return moved


class ZeRO1(_Sharded):
    """The params on every device; gradients and optimizer state 1/N per device."""

    name = "optimizer"

    def __init__(self, state, n: int, grad_accum: int = 1, pack: bool = False,
                 replicas: int = 1):
        super().__init__(state, n, split_params=False, pack=pack, replicas=replicas)

    grad_target = Replicated.grad_target
    full_params = Replicated.full_params

    @classmethod
    def memory(cls, params, opt_state, n, grad_accum=1, compute_bytes=None, ema=False,
               model_bytes=0):
        p = tree_bytes(params)
        # Not a micro-batch's whole gradients besides their sum: XLA updates
        # the sum leaf by leaf as the backward pass makes them
        # (tests/test_estimate.py holds the estimate to XLA's analysis).
        return {"model": 0, "params": p,
                "optimizer": (split_bytes(opt_state, n) + (p if ema else 0)) / n,
                "gradients": p, "update": split_bytes(params, n) / n}


class FSDP(_Sharded):
    """Params, gradients and optimizer state 1/N per device.

    With one micro-batch each param is gathered where the model uses it and
    its gradient reduce-scattered as the backward pass produces it; with
    `grad_accum` > 1 the params are gathered once per step and the summed
    gradients reduce-scattered once, whatever the number of micro-batches.
    """

    name = "full"

    def __init__(self, state, n: int, grad_accum: int = 1, pack: bool = False,
                 replicas: int = 1):
        super().__init__(state, n, split_params=True, pack=pack, replicas=replicas)
        self.grads_in_backward = grad_accum == 1

    def grad_target(self, params, dtypes):
        if not self.grads_in_backward:  # gather once; `reduce` scatters the summed gradients
            return Replicated.grad_target(self, self.full_params(params), dtypes)
        return params, lambda slices: jax.tree.map(
            lambda s, x: _gather_reducing(x, s, (x.dtype, *dtypes)), self.grad_splits, slices)

    def full_params(self, params):
        return jax.tree.map(lambda s, x: s.gather(x), self.grad_splits, params)

    @classmethod
    def memory(cls, params, opt_state, n, grad_accum=1, compute_bytes=None, ema=False,
               model_bytes=0):
        p = tree_bytes(params)
        sharded = split_bytes(params, n) / n  # 1/N at rest
        # One micro-batch: each param gathered where it is used, and the gathered
        # copy kept for the backward pass (in the compute dtype); several: the
        # step gathers all params once and sums whole gradients, besides which
        # it keeps one micro-batch's.
        gathered = p * (compute_bytes or 4) // 4 if grad_accum == 1 else p
        return {"model": 0, "params": sharded + gathered,
                "optimizer": (split_bytes(opt_state, n) + (split_bytes(params, n) if ema else 0))
                / n,
                "gradients": p + p if grad_accum > 1 else sharded, "update": sharded}

    @classmethod
    def step_collectives(cls, params, n, grad_accum=1, compute_bytes=None, replicas=1):
        moved = super().step_collectives(params, n, grad_accum, compute_bytes, replicas)
        if "all-gather" in moved and compute_bytes and grad_accum == 1:  # in the compute dtype
            moved["all-gather"] = moved["all-gather"] * compute_bytes // 4
        return moved


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_reducing(local, split: Split, dtypes):
    """`split.gather` in the compute dtype (bf16 halves the bytes gathered),
    whose gradient is this device's slice of the sum over devices: the
    reduce-scatter runs as the backward pass reaches each param, in the
    all-reduce dtype. `dtypes`: (the param dtype, the compute dtype, the
    all-reduce dtype), None: as stored."""
    return split.gather(local.astype(dtypes[1] or dtypes[0]))


def _gather_reducing_fwd(local, split, dtypes):
    return _gather_reducing(local, split, dtypes), None


def _gather_reducing_bwd(split, dtypes, _, cotangent):
    # As replicated: the per-device gradient in the param dtype, then summed
    # over the devices in the all-reduce dtype.
    dtype, _, allreduce_dtype = dtypes
    g = cotangent.astype(dtype).astype(allreduce_dtype or dtype)
    return (split.scatter_sum(g).astype(dtype),)


_gather_reducing.defvjp(_gather_reducing_fwd, _gather_reducing_bwd)


# -- the state as stored, and as checkpoints hold it ----------------------------------
def specs(layout: Layout):
    """A PartitionSpec per state leaf."""
    return jax.tree.map(lambda s: s.spec, layout.splits)


def stored(layout: Layout, state):
    """The stored (padded) state from a logical one (host or traced)."""
    return jax.tree.map(lambda s, x: s.pad(x), layout.splits, state)


def logical(layout: Layout, state):
    """The logical state from a stored one, traced under jit: XLA keeps every
    leaf split as it is stored (the padding is implicit)."""
    return jax.tree.map(lambda s, x: s.unpad(x), layout.splits, state)


def host_logical(split: Split, leaf, mesh) -> Any:
    """A split leaf in its logical shape, outside the step, on the host (one
    copy, not one per device; a leaf that is not split is returned as it is).
    With several processes it is gathered over the mesh first, whole on
    every device until its host copy is made: one leaf at a time, as a split
    state may not fit one device whole."""
    if split.dim is None:
        return leaf
    if jax.process_count() == 1:
        return split.unpad(np.asarray(leaf))
    return np.asarray(_replicated_unpad(split, mesh)(leaf))


@functools.cache
def _replicated_unpad(split: Split, mesh):
    return jax.jit(split.unpad, out_shardings=NamedSharding(mesh, P()))


def state_dict(layout: Layout, state, mesh=None) -> dict[str, Any]:
    """{path: array} of one logical copy of a stored state: what checkpoints
    hold, the same for every device count and layout."""
    out = {}
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, leaf), split in zip(paths, jax.tree.leaves(layout.splits)):
        if is_key(leaf):  # saved as raw data; from_state_dict wraps it again
            leaf = jax.random.key_data(leaf)
        if _split_evenly(split):
            # Split evenly: the stored array is the logical one, sharded.
            # Orbax writes each process's shards; nothing is gathered.
            out[_key(path)] = leaf
        else:
            out[_key(path)] = host_logical(split, leaf, mesh)
    return out


def template(layout: Layout, state) -> dict[str, Any]:
    """`state_dict`'s restore target for a stored `state`, from shapes alone
    (nothing is copied or gathered): an unfilled host array per path, or for
    a leaf split evenly a `jax.ShapeDtypeStruct` with its sharding, which
    Orbax reads straight onto the devices, each process its own shards. So no
    process holds such a leaf whole, in host memory or on a device."""
    out = {}
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, leaf), split in zip(paths, jax.tree.leaves(layout.splits)):
        if is_key(leaf):  # saved as raw data
            like = jax.eval_shape(jax.random.key_data,
                                  jax.ShapeDtypeStruct(split.shape, leaf.dtype))
            out[_key(path)] = np.empty(like.shape, like.dtype)
        elif _split_evenly(split):
            out[_key(path)] = jax.ShapeDtypeStruct(split.shape, leaf.dtype,
                                                   sharding=leaf.sharding)
        else:
            out[_key(path)] = np.empty(split.shape, leaf.dtype)
    return out


def _split_evenly(split: Split) -> bool:
    """Split, and its stored leaf is its logical one (no padding)."""
    return split.dim is not None and split.padded_shape == split.shape


def from_state_dict(layout: Layout, flat: dict[str, Any], template, adopt: bool = False):
    """A stored state shaped like `template` (arrays, or `jax.ShapeDtypeStruct`s
    with their shardings) from a `state_dict` of any device count and layout.

    A leaf split evenly that is already a device array of its template's
    sharding stays on the devices (a multi-process state cannot be read
    whole into one process): taken as it is when `adopt` (a checkpoint's
    fresh arrays), else copied there, since the step donates the state's
    buffers and the caller's arrays must outlive it. Any other value goes
    through the host and is placed by the caller."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [_key(p) for p, _ in paths if _key(p) not in flat]
    if missing:
        raise DpaxError(f"checkpoint lacks {len(missing)} state entries, e.g. {missing[0]}; "
                        "it was saved for another model or optimizer")

    def leaf(path, like, split):
        value = flat[_key(path)]
        if is_key(like):
            return jax.random.wrap_key_data(np.asarray(value), impl=jax.random.key_impl(like))
        if (isinstance(value, jax.Array) and _split_evenly(split)
                and value.sharding == like.sharding):
            return value if adopt else jax.device_put(value, like.sharding, may_alias=False)
        return split.pad(np.asarray(value))

    return jax.tree.unflatten(treedef, [leaf(p, t, s) for (p, t), s in
                                        zip(paths, jax.tree.leaves(layout.splits))])


def host_params(layout: Layout, params, mesh=None):
    """The params (or EMA) in their model shapes, outside the step."""
    splits = layout.splits.params
    return jax.tree.map(lambda s, x: host_logical(s, x, mesh), splits, params)


def _key(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


# The built-in layouts by the name `Trainer(sharding=...)` takes.
LAYOUTS: dict[str, type[Layout]] = {"replicated": Replicated, "optimizer": ZeRO1,
                                    "full": FSDP}
SHARDINGS = tuple(LAYOUTS)


# What a class must define to be taken as a layout (the `Layout` protocol's).
_LAYOUT_MEMBERS = ("name", "whole_state", "per_device_update", "grads_in_backward",
                   "sums_elementwise", "grad_target", "reduce", "full_params", "memory",
                   "least_collectives", "step_collectives")


def layout_class(sharding: str | type[Layout]) -> type[Layout]:
    """The layout class named `sharding`, or `sharding` itself when it is a
    layout class; anything else is refused."""
    if isinstance(sharding, str) and sharding in LAYOUTS:
        return LAYOUTS[sharding]
    if isinstance(sharding, type) and all(hasattr(sharding, m) for m in _LAYOUT_MEMBERS):
        return sharding
    raise DpaxError(f"`sharding` must be one of {', '.join(LAYOUTS)} or a layout class "
                    f"(`dpax.parallel.layout.Layout`), got {sharding!r}")


def check_sharding(sharding: str | type[Layout], backend: str) -> None:
    """The one place the rule lives: a known layout; a split one on shard_map."""
    cls = layout_class(sharding)
    if not cls.whole_state and backend != "shard_map":
        raise DpaxError(f"`sharding={cls.name}` needs `backend=shard_map` (pmap replicates "
                        "every array)")


def make_layout(sharding: str | type[Layout], backend, state, grad_accum: int = 1) -> Layout:
    """The layout `sharding` (a name or a layout class, checked:
    `check_sharding`) for a logical `state` on the backend's devices, in its
    replica groups."""
    cls = layout_class(sharding)
    groups = {"replicas": backend.replicas} if backend.replicas > 1 else {}
    if groups and "replicas" not in inspect.signature(cls).parameters:
        raise DpaxError(f"the layout class {cls.__name__} takes no `replicas` (hybrid "
                        "sharding's groups); leave `replicas` out or give the class that "
                        "keyword")
    layout = cls(state, backend.n, grad_accum, backend.platform.pack_collectives, **groups)
    if not hasattr(layout, "axis"):  # a class written before groups: every device on one axis
        layout.axis = AXIS
    return layout
