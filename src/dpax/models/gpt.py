"""A decoder-only transformer (GPT-2's shape) for ONE device, in Flax NNX.

Causal self-attention, pre-LayerNorm blocks, a GELU MLP (tanh), learned
positions and an output layer tied to the token embedding, as nanoGPT's
`model.py`: GPT-2's architecture, so Hugging Face GPT-2 weights load and save
exactly (`dpax.models.hf_gpt2`).
Dropout is `nnx.Dropout`, which dpax turns into per-example masks that do not
depend on the device count. `remat` trades compute for activation memory with
`jax.checkpoint` per block:

  none    keep every activation for the backward pass
  block   keep only each block's input; recompute the block in the backward
  dots    keep the results of matmuls without batch dimensions (the
          projections and the MLP), recompute the rest (attention scores,
          softmax, GELU, LayerNorm): most of the saving at a fraction of the cost
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dpax.errors import DpaxError
from dpax.models.kv_cache import KVCache, empty, through_cache

# GPT-2's LayerNorm epsilon (Flax's default is 1e-6): Hugging Face GPT-2
# weights import and export exactly (`dpax.models.hf_gpt2`).
LAYER_NORM_EPSILON = 1e-5

REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def check_shape(width: int, heads: int, remat: str) -> None:
    """The GPT's rules on its options (the config checks them with this too)."""
    if width % heads:
        raise DpaxError(f"gpt: `width` {width} must be a multiple of `heads` {heads}")
    if remat not in REMAT_POLICIES:
        raise DpaxError(f"`remat` must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")


# cuDNN's fused attention takes half-precision inputs with heads of a
# multiple of 8 features, up to 128 in dpax (the size every generation it
# runs on takes), on GPUs from compute capability 8.0 (Ampere).
CUDNN_MAX_HEAD = 128
CUDNN_MIN_CAPABILITY = 8.0


def causal_attention(q, k, v, segments=None):
    """Causal self-attention of (batch, tokens, heads, head size) arrays as
    the platform runs it best: cuDNN's fused kernel where the program runs on
    an NVIDIA GPU that takes these inputs, XLA's formulation elsewhere (the
    same numbers as `jax.nn.dot_product_attention` with its defaults). The
    platform is the compiled program's (`jax.lax.platform_dependent`), not
    the host's: a CPU program on a GPU host takes XLA's. With `segments`
    (batch, tokens) of packed windows (`dpax.data.text.pack`), a token
    attends only to the tokens of its own segment (XLA's formulation)."""
    if segments is not None:
        same = segments[:, None, :, None] == segments[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True,
                                            implementation="xla")

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    if not cudnn_takes(q.dtype, q.shape[-1], _cuda_capability()):
        return xla(q, k, v)
    try:  # cuDNN's own checks (its version, the shapes) run as this traces
        return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=xla)
    except (NotImplementedError, RuntimeError, ValueError):
        return xla(q, k, v)


def cudnn_takes(dtype, head_size: int, capability: float | None) -> bool:
    """Whether cuDNN's fused attention takes `dtype` inputs with heads of
    `head_size` on a GPU of compute `capability` (None: no NVIDIA GPU)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = head_size % 8 == 0 and head_size <= CUDNN_MAX_HEAD
    return capability is not None and capability >= CUDNN_MIN_CAPABILITY and half and fits


@functools.cache
def _cuda_capability() -> float | None:
    """The compute capability of this host's first NVIDIA GPU, or None."""
    try:
        gpu = jax.devices("cuda")[0]
    except RuntimeError:
        return None
    return float(getattr(gpu, "compute_capability", 0) or 0)


class Block(nnx.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, dropout: float, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(width, epsilon=LAYER_NORM_EPSILON, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, epsilon=LAYER_NORM_EPSILON, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.drop_attn = nnx.Dropout(dropout, rngs=rngs)
        self.drop_mlp = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, segments=None):
        # Padding sits at the end of a window, so the causal mask alone keeps
        # real positions from seeing it.
        packed = () if segments is None else (segments,)
        return self.finish(x, causal_attention(*self.qkv_heads(x), *packed))

    def qkv_heads(self, x):
        """Queries, keys and values of (b, t, width) inputs: (b, t, heads, head size) each."""
        b, t, c = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        return tuple(a.reshape(b, t, self.heads, c // self.heads) for a in (q, k, v))

    def finish(self, x, y):
        """The block's output from its input and the attention's (b, t, heads, head size)."""
        x = x + self.drop_attn(self.proj(y.reshape(x.shape)))
        return x + self.drop_mlp(self.down(nnx.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
    """Token ids (b, t) -> next-token logits (b, t, vocab), for t <= seq_len."""

    def __init__(self, vocab: int, seq_len: int, *, layers: int = 4, width: int = 128,
                 heads: int = 4, dropout: float = 0.0, remat: str = "none",
                 rngs: nnx.Rngs):
        check_shape(width, heads, remat)
        self.seq_len, self.remat = seq_len, remat
        init = nnx.initializers.normal(0.02)  # GPT-2's
        self.wte = nnx.Embed(vocab, width, embedding_init=init, rngs=rngs)
        self.wpe = nnx.Embed(seq_len, width, embedding_init=init, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, dropout, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(width, epsilon=LAYER_NORM_EPSILON, rngs=rngs)

    def __call__(self, tokens, segments=None):
        """`segments`: packed windows' segment id per token (None: one text
        per window); each segment's positions start at 0."""
        if tokens.shape[1] > self.seq_len:  # a position past the table reads NaN
            raise DpaxError(
                f"the GPT reads at most {self.seq_len} tokens a window (its seq_len), got "
                f"{tokens.shape[1]}: make it with seq_len {tokens.shape[1]} (or the windows "
                f"{self.seq_len + 1} tokens long for dpax.lm_loss)")
        tokens = tokens.astype(jnp.int32)
        x = self.drop(self.wte(tokens) + self.wpe(positions(tokens.shape[1], segments)))
        extra = () if segments is None else (segments,)
        for block in self.blocks:
            x = block_call(self.remat)(block, x, *extra)
        # Tied output layer: the logits are the embedding's attend (x @ E^T).
        return self.wte.attend(self.ln_f(x))


    def cached(self, tokens, cache: KVCache, pos):
        """Logits of `tokens` (b, t) at positions pos..pos+t-1, attending to
        the keys and values `cache` holds of the positions before them;
        returns (logits, the cache with theirs added). pos + t <= seq_len."""
        t = tokens.shape[1]
        x = self.wte(tokens.astype(jnp.int32)) + self.wpe(pos + jnp.arange(t))
        x, cache = through_cache(self.blocks, lambda block, x: block.qkv_heads(x), x, cache, pos)
        return self.wte.attend(self.ln_f(x)), cache

    def empty_cache(self, batch: int, dtype=jnp.float32) -> KVCache:
        """A cache of `seq_len` positions for every layer, empty."""
        block = self.blocks[0]
        return empty(len(self.blocks), (batch, self.seq_len, block.heads,
                                        block.qkv.in_features // block.heads), dtype)


def positions(t: int, segments=None):
    """Each token's position: its index (t,), or with `segments` (b, t) its
    index from the start of its segment."""
    index = jnp.arange(t)
    if segments is None:
        return index
    start = jnp.concatenate([jnp.ones_like(segments[:, :1], bool),
                             segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(start, index, 0), axis=1)


def block_call(remat: str):
    """A fresh function per block: `jax.checkpoint` reuses the trace of a
    function it has seen with the same shapes, which would give every block
    the first one's dropout streams (`dpax.models.layers.ExampleDropout` numbers its
    calls while tracing)."""
    def call(block, *inputs):
        return block(*inputs)

    return call if remat == "none" else nnx.remat(call, policy=REMAT_POLICIES[remat])


def flops_per_token(n_params: int, layers: int, width: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter that multiplies (2 forward, 4
    backward; `n_params` leaves out the position table, which only adds) plus
    attention's 12 * layers * width * seq_len (PaLM's appendix B)."""
    return 6.0 * n_params + 12.0 * layers * width * seq_len
