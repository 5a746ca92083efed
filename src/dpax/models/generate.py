"""Text from a language model: a continuation of a prompt.

Token ids in, token ids out (`dpax.data.tokenizer` turns text into ids and
back). The model sees at most its `seq_len` last tokens (the context it was
trained on); the whole generation is one compiled loop on one device.

A model with a key/value cache (`cached` and `empty_cache`, as
`dpax.models.gpt.GPT` has) computes each new token from the cache of the
tokens before it while they fit its context: the prompt once, then one token
per step. Past `seq_len` tokens, and for any other model, each token is
computed from the window of the last `seq_len` tokens again. Both give the
same logits up to float rounding, so greedy sampling the same tokens.

Each token is drawn from the logits at `temperature` (0: the most likely),
among the `top_k` most likely and the smallest set whose probabilities add
up to `top_p` (nucleus sampling).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpax.errors import DpaxError


def check(prompt, tokens: int, temperature: float, top_k: int | None = None,
          top_p: float | None = None) -> None:
    """Refuse arguments no generation can use, naming the fix."""
    if not len(prompt):
        raise DpaxError("`prompt` is empty; give at least one character, e.g. `prompt='def'`")
    if tokens < 1:
        raise DpaxError(f"`tokens` must be >= 1, got {tokens}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise DpaxError(f"`temperature` must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise DpaxError(f"`top_k` must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise DpaxError(f"`top_p` must be in (0, 1], got {top_p}")


def can_cache(model: nnx.Module) -> bool:
    """Does `model` keep a key/value cache for sampling?"""
    return callable(getattr(model, "cached", None)) and callable(
        getattr(model, "empty_cache", None))


def generate(model: nnx.Module, prompt, tokens: int, seq_len: int,
             temperature: float = 0.8, seed: int = 0, top_k: int | None = None,
             top_p: float | None = None, cache: bool = True) -> np.ndarray:
    """The ids of `tokens` tokens that follow the token ids `prompt` (bytes
    are byte tokens), drawn from `model` (token ids (b, t) -> logits (b, t,
    vocab)) at `temperature` among the `top_k` most likely tokens and the
    nucleus of probability `top_p` (None: no such limit). `cache`: use the
    model's key/value cache where it has one (False: recompute the window
    for every token)."""
    check(prompt, tokens, temperature, top_k, top_p)
    model.eval()  # no dropout
    graphdef, state = nnx.split(model)
    start = np.frombuffer(prompt, np.uint8) if isinstance(prompt, bytes) else np.asarray(prompt)
    buf = np.zeros(len(start) + tokens, np.int32)
    buf[:len(start)] = start
    pick = Picker(float(temperature), top_k, top_p)
    # The cache holds positions 0..seq_len-1: the token at seq_len is the last
    # it gives (from the logits at seq_len - 1).
    cached = min(tokens, seq_len + 1 - len(start)) if cache and can_cache(model) else 0
    out = _loop(graphdef, len(start), tokens, seq_len, pick, max(cached, 0))(
        state, jnp.asarray(buf), jax.random.key(seed))
    return np.asarray(out[len(start):])


@functools.lru_cache(maxsize=8)
def _loop(graphdef, prompt_len: int, tokens: int, seq_len: int, pick: Picker, cached: int):
    @jax.jit
    def run(state, buf, key):
        model = nnx.merge(graphdef, state)
        if cached:
            buf = _with_cache(model, buf, key, prompt_len, cached, pick)
        window = min(seq_len, buf.shape[0])

        def body(i, buf):
            cur = prompt_len + i  # the position to fill
            lo = jnp.maximum(0, cur - window)  # the last `window` tokens before it
            ctx = jax.lax.dynamic_slice(buf, (lo,), (window,))
            logits = model(ctx[None])[0, cur - 1 - lo].astype(jnp.float32)
            return buf.at[cur].set(pick(logits, jax.random.fold_in(key, i)).astype(buf.dtype))

        return jax.lax.fori_loop(cached, tokens, body, buf)

    return run


def _with_cache(model, buf, key, prompt_len: int, n: int, pick: Picker):
    """`buf` with its first `n` new tokens filled from the key/value cache:
    the prompt in one call, then one token per step, each drawn with the key
    of its index as the window loop draws it."""
    logits, cache = model.cached(buf[None, :prompt_len], model.empty_cache(1), 0)
    buf = buf.at[prompt_len].set(pick(logits[0, -1].astype(jnp.float32),
                                      jax.random.fold_in(key, 0)).astype(buf.dtype))

    def body(i, carry):
        buf, cache = carry
        cur = prompt_len + i
        token = jax.lax.dynamic_slice(buf, (cur - 1,), (1,))
        logits, cache = model.cached(token[None], cache, cur - 1)
        nxt = pick(logits[0, -1].astype(jnp.float32), jax.random.fold_in(key, i))
        return buf.at[cur].set(nxt.astype(buf.dtype)), cache

    return jax.lax.fori_loop(1, n, body, (buf, cache))[0]


@dataclasses.dataclass(frozen=True)
class Picker:
    """Draws one token id from logits (hashable: it keys the compiled loop)."""

    temperature: float
    top_k: int | None = None
    top_p: float | None = None

    def __call__(self, logits, key):
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        if temperature == 0:
            return jnp.argmax(logits)
        logits = logits / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if top_p is not None and top_p < 1:
            order = jnp.argsort(-logits)
            probs = jax.nn.softmax(logits[order])
            # Keep each token whose more likely ones add up to less than top_p:
            # the most likely always, and the one that crosses top_p.
            keep = (jnp.cumsum(probs) - probs) < top_p
            logits = logits.at[order].set(jnp.where(keep, logits[order], -jnp.inf))
        return jax.random.categorical(key, logits)
