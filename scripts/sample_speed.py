"""Tokens per second of `dpax.models.generate.generate` with and without the
key/value cache, greedy, on one device, for GPTs of the demo's shape and a
longer context; the tokens of both must be the same.

    python scripts/sample_speed.py    # about a minute on 2 cores
"""

import time

import jax
import numpy as np
from flax import nnx

from dpax.models.generate import generate
from dpax.models.gpt import GPT

SHAPES = [  # (layers, width, heads, seq_len, tokens)
    (4, 128, 4, 64, 60), (4, 128, 4, 256, 250), (6, 256, 8, 512, 500)]


def timed(model, seq_len, tokens, cache) -> tuple[float, np.ndarray]:
    generate(model, b"def ", tokens, seq_len, temperature=0.0, cache=cache)  # compile
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = generate(model, b"def ", tokens, seq_len, temperature=0.0, cache=cache)
        times.append(time.perf_counter() - t0)
    return tokens / float(np.median(times)), out


def main() -> None:
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| layers x width, context | tokens | with cache (tok/s) | without (tok/s) | "
          "speed-up | same tokens |")
    print("|---|---|---|---|---|---|")
    for layers, width, heads, seq_len, tokens in SHAPES:
        model = GPT(256, seq_len, layers=layers, width=width, heads=heads, rngs=nnx.Rngs(0))
        (fast, a), (slow, b) = (timed(model, seq_len, tokens, c) for c in (True, False))
        print(f"| {layers} x {width}, {seq_len} | {tokens} | {fast:,.0f} | {slow:,.0f} | "
              f"{fast / slow:.1f}x | {bool((a == b).all())} |")


if __name__ == "__main__":
    main()
