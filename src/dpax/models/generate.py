"""Text from a language model: a continuation of a prompt.

Token ids in, token ids out (`dpax.data.tokenizer` turns text into ids and
back). The model sees at most its `seq_len` last tokens (the context it was
trained on); the whole generation is one compiled loop on one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpax.errors import DpaxError


def check(prompt, tokens: int, temperature: float) -> None:
    """Refuse arguments no generation can use, naming the fix."""
    if not len(prompt):
        raise DpaxError("`prompt` is empty; give at least one character, e.g. `prompt='def'`")
    if tokens < 1:
        raise DpaxError(f"`tokens` must be >= 1, got {tokens}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise DpaxError(f"`temperature` must be a finite number >= 0, got {temperature}")


def generate(model: nnx.Module, prompt, tokens: int, seq_len: int,
             temperature: float = 0.8, seed: int = 0) -> np.ndarray:
    """The ids of `tokens` tokens that follow the token ids `prompt` (bytes
    are byte tokens), drawn at `temperature` (0: the most likely token each
    time) from `model` (token ids (b, t) -> logits (b, t, vocab))."""
    check(prompt, tokens, temperature)
    model.eval()  # no dropout
    graphdef, state = nnx.split(model)
    start = np.frombuffer(prompt, np.uint8) if isinstance(prompt, bytes) else np.asarray(prompt)
    buf = np.zeros(len(start) + tokens, np.int32)
    buf[:len(start)] = start
    out = _loop(graphdef, len(start), tokens, seq_len, float(temperature))(
        state, jnp.asarray(buf), jax.random.key(seed))
    return np.asarray(out[len(start):])


@functools.lru_cache(maxsize=8)
def _loop(graphdef, prompt_len: int, tokens: int, seq_len: int, temperature: float):
    @jax.jit
    def run(state, buf, key):
        model = nnx.merge(graphdef, state)
        window = min(seq_len, buf.shape[0])

        def body(i, buf):
            cur = prompt_len + i  # the position to fill
            lo = jnp.maximum(0, cur - window)  # the last `window` tokens before it
            ctx = jax.lax.dynamic_slice(buf, (lo,), (window,))
            logits = model(ctx[None])[0, cur - 1 - lo].astype(jnp.float32)
            if temperature == 0:
                nxt = jnp.argmax(logits)
            else:
                nxt = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
            return buf.at[cur].set(nxt.astype(buf.dtype))

        return jax.lax.fori_loop(0, tokens, body, buf)

    return run
