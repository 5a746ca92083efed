"""The model as a step computes it in a compute dtype (`precision="bf16"`):
its floating-point params cast to that dtype, and every layer computing in it.

Flax's layers compute in the dtype of their inputs and params unless given a
`dtype`, so casting the params is enough for most of them, with one
exception: `nnx.Embed` fixes its `dtype` to its params' (float32) when it is
built without one, and an embedding in float32 promotes every layer after it
back to float32. An `nnx.Embed` (the class itself, not a subclass) whose
`dtype` is its `param_dtype`, as built with none, here looks its rows up in
float32 and returns them in the compute dtype; its `attend` computes in the
compute dtype. The lookup stays in float32 because its gradient is a
scatter-add into the table: in bf16 each row's sum over the batch's tokens
would be rounded at every addition, losing much of a frequent token's
update, and by an amount that depends on how many tokens each device sums;
in float32 it is rounded once. One built with another `dtype` keeps it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def cast_floats(tree, dtype):
    """`tree` with its floating-point arrays in `dtype` (None: as they are)."""
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


class _LookupInFloat32(nnx.Embed):
    """An `nnx.Embed` whose `dtype` is the compute dtype: rows looked up from
    its table in float32 (its params' dtype if wider), returned in `dtype`.
    `nnx.Embed.__call__`, but for the lookup's dtype; it sets nothing on the
    module, which a call inside a JAX transform (vmap, checkpoint) may not."""

    def __call__(self, inputs, out_sharding=None):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        lookup = jnp.promote_types(self.param_dtype, jnp.float32)
        (table,) = self.promote_dtype((self.embedding[...],), dtype=lookup, inexact=False)
        if self.num_embeddings == 1:
            rows = jnp.broadcast_to(table, inputs.shape + (self.features,))
        elif out_sharding is not None:
            take = jax.sharding.auto_axes(lambda t, i: jnp.take(t, i, axis=0),
                                          out_sharding=out_sharding)
            rows = take(table, inputs)
        else:
            rows = jnp.take(table, inputs, axis=0)
        return rows.astype(self.dtype)


def model_in(graphdef: nnx.GraphDef, params, rest, dtype: Any) -> nnx.Module:
    """The model of `graphdef` with `params` cast to `dtype` and `rest` as
    it is, its embeddings computing in `dtype` (None: the model as stored).
    The model is this trace's own (`nnx.merge`), so its embeddings' class
    and dtype can change: the user's model and `graphdef` keep theirs."""
    model = nnx.merge(graphdef, cast_floats(params, dtype), rest)
    if dtype is not None:
        for _, module in nnx.iter_modules(model):
            if type(module) is nnx.Embed and module.dtype == module.param_dtype:
                module.__class__ = _LookupInFloat32
                module.dtype = dtype
    return model
