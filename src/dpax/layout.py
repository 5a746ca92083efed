"""How the training state lives on the devices, and how a step updates it.

A layout owns what must agree: the PartitionSpec of every state leaf, the
params the model runs on inside a step, the per-device update that turns
gradient sums into new params and optimizer state, and the translation to and
from the device-count-independent `state_dict` that checkpoints hold.

  replicated  every device holds the whole state (plain data parallelism)
  optimizer   ZeRO-1: each device keeps 1/N of the optimizer state; the
              gradients are reduce-scattered, each device updates its slice
              of the params, and the params are all-gathered
  full        FSDP (ZeRO-3): params, gradients and optimizer state 1/N per
              device; the params are all-gathered for the forward and
              backward pass, the gradients reduce-scattered in the backward

Sharded leaves are flattened and zero-padded to a multiple of N, so any
device count splits any shape. The padding stays zero (its gradient is zero,
and every elementwise optimizer maps a zero param with zero gradient and zero
moments to zero), adds nothing to the gradient norm, and never reaches a
checkpoint: `state_dict` holds the logical shapes, the same for every layout
and device count.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpax.collectives import psum_packed, reduce_scatter
from dpax.errors import DpaxError
from dpax.sharding import is_key, padded_size

AXIS = "data"  # the one mesh axis: devices, each with its rows of the batch
SHARDINGS = ("replicated", "optimizer", "full")


def sum_of_squares(tree) -> jax.Array:
    """Sum of every squared element in f32: non-finite if any element is (or if
    the norm overflows f32, a gradient no step should apply either). One
    reduction per leaf: a concatenation of the leaves would be copied first."""
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


def _apply(tx, grad_sums, count, norm, opt_state, params, clip_norm):
    """The optimizer step on mean gradients, clipped to `clip_norm` by the
    global norm (optax.clip_by_global_norm's formula, with the norm of the
    whole gradient even where this device holds a slice of it)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / count, grad_sums)
    if clip_norm is not None:
        small = norm < clip_norm
        grads = jax.tree.map(lambda g: jax.lax.select(small, g, g / norm * clip_norm), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


class Replicated:
    """Every field of the state on every device; one all-reduce per step."""

    name = "replicated"

    def physical(self, state, tx):
        """The state as it lives on the devices, from a logical one whose
        opt_state is still to be made (`tx.init`)."""
        return state.replace(opt_state=tx.init(state.params))

    def specs(self, state) -> Any:
        """A PartitionSpec tree prefix of `state`; None: all replicated."""
        return None

    def grad_target(self, params, compute_dtype, allreduce_dtype):
        """In the step: (what to differentiate, the function that turns it into
        the params the model runs on)."""
        # Differentiate this device's own loss sum. Without the cast, shard_map
        # would transpose the replicated params into an implicit psum, and the
        # explicit one in reduce_and_update would count every gradient N times.
        return jax.lax.pcast(params, AXIS, to="varying"), lambda p: p

    grads_reduced = False  # True: grad_target's gradients arrive already summed

    def full_params(self, params):
        """In the step: the whole params, from this device's part of them."""
        return params

    def reduce_and_update(self, tx, state, loss_sum, count, grad_sums, sums, clip_norm=None,
                          skip_nonfinite=True):
        """Per device: all-reduce this shard's sums and apply the update.

        Returns (loss_sum, count, sums, params, opt_state, grad_norm, finite),
        the sums global; `finite` is False when the step must be skipped, and
        then (with `skip_nonfinite`) params and opt_state are the old ones.
        """
        # One all-reduce for everything (sums add up exactly across devices),
        # packed into as few buffers as possible.
        loss_sum, count, grad_sums, sums = psum_packed((loss_sum, count, grad_sums, sums), AXIS)
        # One pass over the summed gradients gives the norm and the finiteness
        # test (a NaN or inf anywhere makes the sum of squares non-finite); the
        # division then fuses into the update instead of being stored and read
        # twice more.
        sq = sum_of_squares(grad_sums)
        norm = jnp.sqrt(sq) / count
        finite = jnp.isfinite(sq) & jnp.isfinite(loss_sum)

        def update():
            return _apply(tx, grad_sums, count, norm, state.opt_state, state.params, clip_norm)

        if skip_nonfinite:
            # A branch, not a select of new against old: the good path writes
            # the update once instead of making one more pass over params and
            # moments (and the donated buffers are updated in place).
            params, opt_state = jax.lax.cond(finite, update,
                                             lambda: (state.params, state.opt_state))
        else:
            params, opt_state = update()
        return loss_sum, count, sums, params, opt_state, norm, finite

    def logical_params(self, params):
        """The params in their model shapes (outside the step), replicated."""
        return params

    def to_logical(self, key: str, leaf):
        """A state_dict entry from a state leaf (the same here)."""
        return leaf

    def from_logical(self, key: str, value, like):
        """A state leaf from a state_dict entry (the same here)."""
        return value

    def state_dict(self, state) -> dict[str, Any]:
        """{path: array} of one logical copy of `state`: what checkpoints hold,
        the same for every device count and layout."""
        out = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            key = _key(path)
            if is_key(leaf):  # saved as raw data; from_state_dict wraps it again
                leaf = jax.random.key_data(leaf)
            out[key] = self.to_logical(key, leaf)
        return out

    def from_state_dict(self, flat: dict[str, Any], template):
        """A state shaped like `template` from a `state_dict` (of any device
        count and layout)."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(template)
        missing = [_key(p) for p, _ in paths if _key(p) not in flat]
        if missing:
            raise DpaxError(f"checkpoint lacks {len(missing)} state entries, e.g. {missing[0]}; "
                            "it was saved for another model or optimizer")

        def leaf(path, like):
            value = flat[_key(path)]
            if is_key(like):
                return jax.random.wrap_key_data(np.asarray(value), impl=jax.random.key_impl(like))
            return self.from_logical(_key(path), value, like)

        return jax.tree.unflatten(treedef, [leaf(p, t) for p, t in paths])


class Sharded(Replicated):
    """ZeRO-1 (`full=False`) or FSDP (`full=True`) over flat, padded leaves.

    Exact for elementwise optimizers (SGD, momentum, Adam, AdamW): each element
    sees the same gradient and state as when replicated. With `grad_accum` > 1
    the full params are gathered once per step and the summed gradients
    reduce-scattered once, whatever the number of micro-batches; with one
    micro-batch each param is gathered where the model uses it and its
    gradient reduce-scattered as the backward pass produces it.
    """

    def __init__(self, mesh, full: bool, grad_accum: int = 1):
        self.n, self.full = mesh.size, full
        self.name = "full" if full else "optimizer"
        self.grads_reduced = full and grad_accum == 1
        self._param_shapes: list[tuple[int, ...]] = []
        self._logical: dict[str, tuple[int, ...]] = {}  # sharded key -> logical shape
        self._unpad = jax.jit(_unpad, static_argnums=1,
                              out_shardings=NamedSharding(mesh, P()))

    def _flat(self, x):
        x = np.asarray(x).reshape(-1)
        return np.pad(x, (0, padded_size(x.size, self.n) - x.size))

    def physical(self, state, tx):
        self._param_shapes = [np.shape(x) for x in jax.tree.leaves(state.params)]
        flat = jax.tree.map(self._flat, state.params)
        logical = state.replace(opt_state=jax.eval_shape(tx.init, state.params))
        out = state.replace(params=flat if self.full else state.params, opt_state=tx.init(flat))
        if self.full and state.ema is not None:  # the EMA lives like the params
            out = out.replace(ema=jax.tree.map(self._flat, state.ema))
        for (path, leaf), like in zip(jax.tree_util.tree_flatten_with_path(out)[0],
                                      jax.tree.leaves(logical)):
            key = _key(path)
            # Every param and EMA leaf (when full) and every optimizer vector;
            # scalars (step counts) stay replicated.
            if (key.startswith(("params", "ema")) and self.full) or (
                    key.startswith("opt_state") and np.ndim(leaf)):
                self._logical[key] = tuple(np.shape(like))
        return out

    def specs(self, state) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: P(AXIS) if _key(path) in self._logical else P(), state)

    def grad_target(self, params, compute_dtype, allreduce_dtype):
        if not self.grads_reduced:  # ZeRO-1, or FSDP with micro-batches: gather
            # once, and reduce(-scatter) the summed gradients once
            return super().grad_target(self.full_params(params), compute_dtype, allreduce_dtype)

        return params, lambda shards: self._per_param(
            lambda x, s: _gather_reducing(x, s, (x.dtype, compute_dtype, allreduce_dtype)),
            shards)

    def full_params(self, params):
        return self._gathered(params) if self.full else params

    def _gathered(self, slices):
        """In the step: whole params from every device's slice."""
        return self._per_param(_gather, slices)

    def _per_param(self, fn, tree):
        """`fn(leaf, logical shape)` over a params-shaped tree."""
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [fn(x, s) for x, s in zip(leaves, self._param_shapes)])

    def reduce_and_update(self, tx, state, loss_sum, count, grad_sums, sums, clip_norm=None,
                          skip_nonfinite=True):
        if self.grads_reduced:
            grads = grad_sums  # reduce-scattered in the backward pass (`_gather_reducing`)
        else:
            grads = jax.tree.map(lambda g: reduce_scatter(_padded(g, self.n), AXIS), grad_sums)
        # The norm of the whole gradient from each device's slice: one more
        # scalar in the all-reduce the step makes anyway.
        loss_sum, count, sums, sq = psum_packed(
            (loss_sum, count, sums, sum_of_squares(grads)), AXIS)
        norm = jnp.sqrt(sq) / count
        params = state.params if self.full else jax.tree.map(self._slice, state.params)
        new, opt_state = _apply(tx, grads, count, norm, state.opt_state, params, clip_norm)
        # A non-finite new param on any device (e.g. a NaN hyperparameter)
        # skips the step too: its slice is the only copy.
        bad = psum_packed(sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(new)), AXIS)
        finite = jnp.isfinite(sq) & (bad == 0) & jnp.isfinite(loss_sum)
        if skip_nonfinite:
            # On this device's slices (1/N of the state), before ZeRO-1's gather:
            # not a pass over the whole params.
            new, opt_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                          (new, opt_state), (params, state.opt_state))
        if not self.full:
            new = self._gathered(new)  # ZeRO-1: every device gets the whole params
        return loss_sum, count, sums, new, opt_state, norm, finite

    def _slice(self, p):
        shard = padded_size(p.size, self.n) // self.n
        start = jax.lax.axis_index(AXIS) * shard
        return jax.lax.dynamic_slice(_padded(p, self.n), (start,), (shard,))

    def logical_params(self, params):
        return self._per_param(self._whole, params) if self.full else params

    def _whole(self, x, shape):
        """A sharded leaf in its logical shape: on the host with one process
        (one copy, not one per device); else replicated over the mesh."""
        if jax.process_count() == 1:
            return _unpad(np.asarray(x), shape)
        return self._unpad(x, shape)

    def to_logical(self, key, leaf):
        if key in self._logical:
            return self._whole(leaf, self._logical[key])
        return leaf

    def from_logical(self, key, value, like):
        if key in self._logical:
            return self._flat(value)
        return value


def _padded(x: jax.Array, n: int) -> jax.Array:
    """`x` flattened and zero-padded to a multiple of n (in the step)."""
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, padded_size(flat.size, n) - flat.size))


def _gather(shard: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A whole leaf from every device's slice, without the padding (in the step)."""
    return jax.lax.all_gather(shard, AXIS, tiled=True)[:math.prod(shape)].reshape(shape)


def _unpad(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return x[:math.prod(shape)].reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_reducing(shard, shape, dtypes):
    """`_gather` in the compute dtype (bf16 halves the bytes gathered), whose
    gradient is this device's slice of the sum over devices: the reduce-scatter
    runs as the backward pass reaches each param, in the all-reduce dtype.
    `dtypes`: (the param dtype, the compute dtype, the all-reduce dtype)."""
    return _gather(shard.astype(dtypes[1] or dtypes[0]), shape)


def _gather_reducing_fwd(shard, shape, dtypes):
    return _gather_reducing(shard, shape, dtypes), None


def _gather_reducing_bwd(shape, dtypes, _, cotangent):
    # As replicated: the per-device gradient in the param dtype, then summed
    # over the devices in the all-reduce dtype.
    dtype, _, allreduce_dtype = dtypes
    g = cotangent.astype(dtype).astype(allreduce_dtype or dtype)
    return (reduce_scatter(_padded(g, jax.lax.axis_size(AXIS)), AXIS).astype(dtype),)


_gather_reducing.defvjp(_gather_reducing_fwd, _gather_reducing_bwd)


def _key(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def check_sharding(sharding: str, backend: str) -> None:
    """The one place the rule lives: a known mode; the sharded ones on shard_map."""
    if sharding not in SHARDINGS:
        raise DpaxError(f"`sharding` must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if sharding != "replicated" and backend != "shard_map":
        raise DpaxError(f"`sharding={sharding}` needs `backend=shard_map` (pmap replicates "
                        "every array)")


def make_layout(sharding: str, backend, grad_accum: int = 1) -> Replicated:
    check_sharding(sharding, backend.name)
    if sharding == "replicated":
        return Replicated()
    return Sharded(backend.mesh, full=sharding == "full", grad_accum=grad_accum)
