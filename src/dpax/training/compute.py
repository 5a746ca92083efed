"""The model as a step computes it in a compute dtype (`precision="bf16"`):
its floating-point params cast to that dtype, and every layer computing in it.

Flax's layers compute in the dtype of their inputs and params unless given a
`dtype`, so casting the params is enough for most of them, with one
exception: `nnx.Embed` fixes its `dtype` to its params' (float32) when it is
built without one, and an embedding in float32 promotes every layer after it
back to float32 (the GPT's matmuls and attention then ran in float32 under
"bf16"). An `nnx.Embed` whose `dtype` is its `param_dtype`, as built with
none, computes in the compute dtype here; one built with another `dtype`
keeps it. A model that keeps a layer in float32 on purpose does it by that
layer's own `dtype` (e.g. a LayerNorm's), or by casting in its code.
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


def model_in(graphdef: nnx.GraphDef, params, rest, dtype: Any) -> nnx.Module:
    """The model of `graphdef` with `params` cast to `dtype` and `rest` as
    it is, its embeddings computing in `dtype` (None: the model as stored)."""
    model = nnx.merge(graphdef, cast_floats(params, dtype), rest)
    if dtype is not None:
        for _, module in nnx.iter_modules(model):
            if isinstance(module, nnx.Embed) and module.dtype == module.param_dtype:
                module.dtype = dtype
    return model
