"""Each layer's keys and values, kept while sampling one token at a time
(`dpax.models.generate`): a model with `cached(tokens, cache, pos)` and
`empty_cache(batch)` computes a token from the cache of the tokens before it
instead of from the whole window again."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Each layer's keys and values, (batch, positions, key/value heads, head size)."""

    keys: tuple
    values: tuple


def empty(layers: int, shape: tuple[int, ...], dtype=jnp.float32) -> KVCache:
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(layers))
    return KVCache(zeros, zeros)


def through_cache(blocks, qkv_heads: Callable, x, cache: KVCache, pos):
    """`x` (b, t, width) at positions pos..pos+t-1 through `blocks`, each
    block's keys and values (`qkv_heads(block, x)`) written into its cache
    and its queries attending to the cache (`attend`); returns (x, cache).
    A block finishes from its input and the attention's output (`finish`)."""
    keys, values = [], []
    for block, k_cache, v_cache in zip(blocks, cache.keys, cache.values):
        q, k, v = qkv_heads(block, x)
        k_cache, v_cache = (jax.lax.dynamic_update_slice_in_dim(c, a.astype(c.dtype), pos, 1)
                            for c, a in ((k_cache, k), (v_cache, v)))
        x = block.finish(x, attend(q, k_cache, v_cache, pos))
        keys.append(k_cache)
        values.append(v_cache)
    return x, KVCache(tuple(keys), tuple(values))


def attend(q, k_cache, v_cache, pos):
    """Attention of queries at positions pos..pos+t-1 to a cache's slots
    0..pos+i (each query to itself and the positions before it), XLA's
    formulation as in training; fewer key/value heads than query heads are
    shared (grouped-query attention)."""
    t, slots = q.shape[1], k_cache.shape[1]
    seen = jnp.arange(slots)[None, :] <= pos + jnp.arange(t)[:, None]
    return jax.nn.dot_product_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype),
                                        mask=seen[None, None], implementation="xla")
