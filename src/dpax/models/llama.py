"""A Llama-family decoder (Llama, Mistral, SmolLM's shape) for ONE device, in Flax NNX.

Pre-norm blocks with RMSNorm, rotary position embeddings (RoPE, the
half-split rotation of Hugging Face's `LlamaForCausalLM`), grouped-query
attention (`kv_heads` key/value heads shared by `heads // kv_heads` query
heads each), a SwiGLU MLP, no biases, and an output layer of its own or tied
to the token embedding. Hugging Face Llama weights load and save exactly
(`dpax.models.hf_llama`).

Like `dpax.models.gpt.GPT` it takes `remat`, dropout (on each block's
residual branches: masks dpax makes per example) and a key/value cache for
sampling (`cached`, `empty_cache`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dpax.errors import DpaxError
from dpax.models.gpt import block_call, causal_attention, positions
from dpax.models.kv_cache import KVCache, empty, through_cache

NORM_EPSILON = 1e-5  # Llama 2 and 3's, SmolLM's, Mistral's `rms_norm_eps`
ROPE_THETA = 10000.0


def mlp_width_for(width: int) -> int:
    """Llama's hidden MLP width: 2/3 of 4 x width (SwiGLU's three matrices
    cost what GPT's two do), rounded up to a multiple of 64."""
    return -(-(8 * width // 3) // 64) * 64


def check_shape(width: int, heads: int, kv_heads: int | None) -> None:
    if width % heads:
        raise DpaxError(f"llama: `width` {width} must be a multiple of `heads` {heads}")
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise DpaxError(f"llama: `kv_heads` {kv_heads} must divide `heads` {heads}")
    if (width // heads) % 2:
        raise DpaxError(f"llama: a head's width ({width} // {heads}) must be even for RoPE")


def rope(x, positions, theta: float):
    """Rotary embedding of (b, t, heads, head size) `x` at `positions` (t,)
    or (b, t): each pair (i, i + head size / 2) of features rotated by
    position x theta^(-2i / head size), as `LlamaForCausalLM` rotates."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angle = positions.astype(jnp.float32)[..., None] * freq  # (..., t, half)
    if angle.ndim == 2:
        angle = angle[None]
    cos, sin = (f(angle)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int, kv_heads: int, mlp_width: int, dropout: float,
                 eps: float, theta: float, *, rngs: nnx.Rngs):
        head = width // heads
        self.heads, self.kv_heads, self.theta = heads, kv_heads, theta
        init = nnx.initializers.normal(0.02)
        linear = dict(use_bias=False, kernel_init=init, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.q = nnx.Linear(width, heads * head, **linear)
        self.k = nnx.Linear(width, kv_heads * head, **linear)
        self.v = nnx.Linear(width, kv_heads * head, **linear)
        self.o = nnx.Linear(heads * head, width, **linear)
        self.mlp_norm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.gate = nnx.Linear(width, mlp_width, **linear)
        self.up = nnx.Linear(width, mlp_width, **linear)
        self.down = nnx.Linear(mlp_width, width, **linear)
        self.drop_attn = nnx.Dropout(dropout, rngs=rngs)
        self.drop_mlp = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, positions, segments=None):
        packed = () if segments is None else (segments,)
        return self.finish(x, causal_attention(*self.qkv_heads(x, positions), *packed))

    def qkv_heads(self, x, positions):
        """Queries (b, t, heads, head size), keys and values (b, t, kv_heads,
        head size) of (b, t, width) inputs at `positions`, rotated."""
        b, t, _ = x.shape
        h = self.attn_norm(x)
        head = self.q.out_features // self.heads
        q = self.q(h).reshape(b, t, self.heads, head)
        k = self.k(h).reshape(b, t, self.kv_heads, head)
        v = self.v(h).reshape(b, t, self.kv_heads, head)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v

    def finish(self, x, y):
        x = x + self.drop_attn(self.o(y.reshape(x.shape[:2] + (-1,))))
        h = self.mlp_norm(x)
        return x + self.drop_mlp(self.down(nnx.silu(self.gate(h)) * self.up(h)))


class Llama(nnx.Module):
    """Token ids (b, t) -> next-token logits (b, t, vocab), for t <= seq_len."""

    def __init__(self, vocab: int, seq_len: int, *, layers: int = 4, width: int = 128,
                 heads: int = 4, kv_heads: int | None = None, mlp_width: int | None = None,
                 tie_embeddings: bool = False, rope_theta: float = ROPE_THETA,
                 norm_eps: float = NORM_EPSILON, dropout: float = 0.0, remat: str = "none",
                 rngs: nnx.Rngs):
        check_shape(width, heads, kv_heads)
        kv_heads = kv_heads or heads
        self.seq_len, self.remat, self.tie_embeddings = seq_len, remat, tie_embeddings
        self.embed = nnx.Embed(vocab, width, embedding_init=nnx.initializers.normal(0.02),
                               rngs=rngs)
        self.blocks = nnx.List([
            Block(width, heads, kv_heads, mlp_width or mlp_width_for(width), dropout,
                  norm_eps, rope_theta, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(width, epsilon=norm_eps, rngs=rngs)
        self.head = None if tie_embeddings else nnx.Linear(
            width, vocab, use_bias=False, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

    def __call__(self, tokens, segments=None):
        """`segments`: as `dpax.models.gpt.GPT`'s (packed windows)."""
        x = self.embed(tokens.astype(jnp.int32))
        where = positions(tokens.shape[1], segments)
        extra = () if segments is None else (segments,)
        for block in self.blocks:
            x = block_call(self.remat)(block, x, where, *extra)
        return self.logits(x)

    def logits(self, x):
        x = self.norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)

    def cached(self, tokens, cache: KVCache, pos):
        """As `dpax.models.gpt.GPT.cached`: logits of `tokens` at positions
        pos.., from and into the key/value cache."""
        positions = pos + jnp.arange(tokens.shape[1])
        x, cache = through_cache(self.blocks, lambda block, x: block.qkv_heads(x, positions),
                                 self.embed(tokens.astype(jnp.int32)), cache, pos)
        return self.logits(x), cache

    def empty_cache(self, batch: int, dtype=jnp.float32) -> KVCache:
        block = self.blocks[0]
        return empty(len(self.blocks), (batch, self.seq_len, block.kv_heads,
                                        block.q.out_features // block.heads), dtype)
