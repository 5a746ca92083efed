"""How the training state lives on the devices, and how a step updates it.

A layout owns three things that must agree: the PartitionSpec of every state
field, the per-device update that turns gradient sums into new params and
optimizer state, and the translation to and from the device-count-independent
`state_dict` that checkpoints hold.

  Replicated        every device holds the whole state (plain data parallelism)
  ShardedOptimizer  ZeRO-1: each device keeps 1/N of the optimizer state; the
                    gradients are reduce-scattered, each device updates its
                    slice of the params, and the params are all-gathered
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from dpax.collectives import psum_packed, reduce_scatter
from dpax.errors import DpaxError
from dpax.sharding import is_key, padded_size

AXIS = "data"  # the one mesh axis: devices, each with its rows of the batch


def sum_of_squares(tree) -> jax.Array:
    """Sum of every squared element in f32: non-finite if any element is (or if
    the norm overflows f32, a gradient no step should apply either). One
    reduction per leaf: a concatenation of the leaves would be copied first."""
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


class Replicated:
    """Every field of the state on every device; one all-reduce per step."""

    def init_opt_state(self, tx: optax.GradientTransformation, params) -> Any:
        return tx.init(params)

    def specs(self, state) -> Any:
        """A PartitionSpec tree prefix of `state`; None: all replicated."""
        return None

    def reduce_and_update(self, tx, state, loss_sum, count, grad_sums, sums):
        """Per device: all-reduce this shard's sums and apply the update.

        Returns (loss_sum, count, sums, params, opt_state, grad_norm, finite
        gradients), the sums global and the same on every replica.
        """
        # One all-reduce for everything (sums add up exactly across devices),
        # packed into as few buffers as possible.
        loss_sum, count, grad_sums, sums = psum_packed((loss_sum, count, grad_sums, sums), AXIS)
        # One pass over the summed gradients gives the norm and the finiteness
        # test (a NaN or inf anywhere makes the sum of squares non-finite); the
        # division then fuses into the update instead of being stored and read
        # twice more.
        sq = sum_of_squares(grad_sums)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / count, grad_sums)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return loss_sum, count, sums, params, opt_state, jnp.sqrt(sq) / count, jnp.isfinite(sq)

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
        """A state shaped like `template` from a `state_dict` (of any device count)."""
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


class ShardedOptimizer(Replicated):
    """ZeRO-1 on the flattened params, padded to a multiple of N so that they
    split into N equal slices. Exact for elementwise optimizers (SGD, momentum,
    Adam): each element sees the same gradient and state as when replicated.
    Checkpoints hold the unpadded length, so they resume on any device count."""

    def __init__(self, n_devices: int, n_params: int):
        self.n, self.n_params = n_devices, n_params
        self.padded = padded_size(n_params, n_devices)

    def init_opt_state(self, tx, params) -> Any:
        flat, _ = ravel_pytree(params)
        return tx.init(jnp.zeros(self.padded, flat.dtype))

    def specs(self, state) -> Any:
        # Vectors of the optimizer state are split over the devices; scalars
        # (step counts) stay replicated.
        return state.replace(
            step=P(), params=P(), model_state=P(), bad_in_a_row=P(), rng=P(),
            opt_state=jax.tree.map(lambda x: P(AXIS) if np.ndim(x) else P(), state.opt_state))

    def reduce_and_update(self, tx, state, loss_sum, count, grad_sums, sums):
        loss_sum, count, sums = psum_packed((loss_sum, count, sums), AXIS)
        flat_p, unravel = ravel_pytree(state.params)
        flat_g, _ = ravel_pytree(grad_sums)
        shard = self.padded // self.n
        pad = self.padded - self.n_params
        g = reduce_scatter(jnp.pad(flat_g, (0, pad)), AXIS)
        g = g.astype(jnp.float32) / count
        start = jax.lax.axis_index(AXIS) * shard
        p = jax.lax.dynamic_slice(jnp.pad(flat_p, (0, pad)), (start,), (shard,))
        updates, opt_state = tx.update(g, state.opt_state, p)
        new = optax.apply_updates(p, updates)
        flat_new = jax.lax.all_gather(new, AXIS, tiled=True)
        # Non-finite gradient or new-param elements on any device: the step is skipped.
        sq, bad = psum_packed((jnp.sum(jnp.square(g)),
                               jnp.sum(~jnp.isfinite(g)) + jnp.sum(~jnp.isfinite(new))), AXIS)
        return (loss_sum, count, sums, unravel(flat_new[:self.n_params]), opt_state,
                jnp.sqrt(sq), bad == 0)

    def to_logical(self, key, leaf):
        if key.startswith("opt_state") and np.ndim(leaf) == 1:
            return leaf[: self.n_params]  # drop the padding to a multiple of N
        return leaf

    def from_logical(self, key, value, like):
        if key.startswith("opt_state") and np.ndim(like) == 1:
            return np.pad(np.asarray(value), (0, self.padded - self.n_params))
        return value


def _key(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def check_sharded_optimizer(backend: str, steps_per_call: int, clip_norm=None) -> None:
    """The one place the rule lives: ZeRO-1 runs on shard_map, one step per
    call, and without a global-norm clip (a slice has no global norm)."""
    if backend != "shard_map" or steps_per_call != 1 or clip_norm is not None:
        raise DpaxError("`shard_optimizer_state` needs `backend=shard_map`, "
                        "`steps_per_call=1` and no `clip_norm` (a slice has no global norm)")


def make_layout(shard_optimizer_state: bool, backend: str, steps_per_call: int,
                n_devices: int, params) -> Replicated:
    if not shard_optimizer_state:
        return Replicated()
    check_sharded_optimizer(backend, steps_per_call)
    return ShardedOptimizer(n_devices, sum(np.size(x) for x in jax.tree.leaves(params)))
