"""The benchmark workloads: models and synthetic data of fixed shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpax import models
from dpax.models import gpt, losses


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    input_shape: tuple[int, ...]
    batch_size: int
    make: Callable[[], nnx.Module]
    flops_per_example: float | None = None  # forward + backward, for FLOP/s
    steps: int = 48  # per timed repeat: ~0.1-2 s, so scheduling noise averages out
    task: str = "classification"  # or "lm": token windows (`dpax.data.text`)
    optimizer: str = "adam"  # what every method trains with (`OPTIMIZERS`)

    def loss(self):
        """dpax's per-example loss_fn for this workload."""
        return losses.for_task(self.task)[0]

    def mean_loss(self, model, x, y):
        """What a hand-written loop minimizes, and the accuracy it reports with
        it, as the seeds' pmap loop does (dpax's built-in losses report it
        too): `(mean loss, accuracy)` over the batch, over tokens for an LM
        (the bench's windows have no padding)."""
        if self.task == "lm":
            logits, labels = model(x[:, :-1]), x[:, 1:].astype(jnp.int32)
        else:
            logits, labels = model(x), y
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

    def masked_loss(self, model, batch):
        """What a hand-written loop that keeps dpax's promise of a batch
        minimizes: dpax's per-example `loss()` on `batch` (`x`, `y`, `mask`),
        the padded rows (mask False) left out, the mean over the batch
        weighted as dpax weights it (over tokens for an LM, in float32);
        `(mean loss, {metric: mean})`."""
        out = self.loss()(model, batch)
        out = out if isinstance(out, tuple) else (out,)
        per_example, metrics, weights = out + ({}, None)[len(out) - 1:]
        mask = batch["mask"]
        weights = jnp.ones(mask.shape) if weights is None else weights.astype(jnp.float32)
        total = jnp.sum(jnp.where(mask, weights, 0.0))

        def mean(v):  # `where`, as dpax: a NaN on a padded row must not count
            w = weights.reshape(weights.shape + (1,) * (v.ndim - 1))
            m = mask.reshape(mask.shape + (1,) * (v.ndim - 1))
            return jnp.sum(jnp.where(m, v.astype(jnp.float32) * w, 0.0), axis=0) / total

        return mean(per_example), {k: mean(v) for k, v in metrics.items()}

    def tx(self):
        return OPTIMIZERS[self.optimizer]()


# What every method of one bench run trains with; Adam by default: what most
# users train with; SGD kept for reference rows.
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.01),
    "momentum": lambda: optax.sgd(0.01, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
}


class PoolCNN(nnx.Module):
    """A conv net from standard layers with one kind of downsampling (what
    users write, not dpax's own CNN): `max` and `avg` 2x2 pools, `max3` 3x3
    stride-2 pools whose windows overlap, `strided` stride-2 convolutions,
    `gap` a global mean before the head."""

    def __init__(self, in_shape, n_out, pool: str, *, rngs: nnx.Rngs):
        h, w, c = in_shape
        stride = 2 if pool == "strided" else 1
        self.pool = pool
        self.conv1 = nnx.Conv(c, 32, kernel_size=(3, 3), strides=stride, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), strides=stride, rngs=rngs)
        features = 64 if pool == "gap" else 64 * (h // 4) * (w // 4)
        self.dense = nnx.Linear(features, n_out, rngs=rngs)

    def _down(self, x):
        if self.pool == "max":
            return nnx.max_pool(x, (2, 2), strides=(2, 2))
        if self.pool == "avg":
            return nnx.avg_pool(x, (2, 2), strides=(2, 2))
        if self.pool == "max3":
            return nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        return x  # strided convolutions downsample; gap pools once at the end

    def __call__(self, x):
        x = self._down(nnx.relu(self.conv1(x)))
        x = self._down(nnx.relu(self.conv2(x)))
        if self.pool == "gap":
            return self.dense(jnp.mean(x, axis=(1, 2)))
        return self.dense(x.reshape(x.shape[0], -1))


def _pool_cnn(pool):
    return lambda: PoolCNN((32, 32, 3), 10, pool, rngs=nnx.Rngs(0))


def _dense_flops(sizes):
    return 6.0 * sum(a * b for a, b in zip(sizes, sizes[1:]))  # 2 forward + 4 backward


# Steps per repeat are multiples of 8, so --steps-per-call 8 runs whole calls only.
# A small GPT: 4 blocks of width 128, 4 heads, 64 tokens.
GPT_SHAPE = {"layers": 4, "width": 128, "heads": 4}
GPT_SEQ = 64


def _gpt():
    return gpt.GPT(256, GPT_SEQ, **GPT_SHAPE, rngs=nnx.Rngs(0))


# GPT-2 small's depth and width on few tokens: a step bound by the
# optimizer's passes over 86M params, not by the matmuls (every other
# workload is the other kind).
WIDE_SHAPE = {"layers": 12, "width": 768, "heads": 12}
WIDE_SEQ = 16


def _gpt_wide():
    return gpt.GPT(256, WIDE_SEQ, **WIDE_SHAPE, rngs=nnx.Rngs(0))


def _gpt_flops(vocab=256, d=128, layers=4):
    """Per window of GPT_SEQ tokens; the weights counted from the shapes (a
    block holds 12 d^2 + 13 d, test_gpt.py checks it), the position table left out."""
    n = vocab * d + layers * (12 * d * d + 13 * d) + 2 * d
    return gpt.flops_per_token(n, layers, d, GPT_SEQ) * GPT_SEQ


WORKLOADS = {
    "tiny": Workload("tiny", (16,), 128,
                     lambda: models.MLP((16,), 10, hidden=(32,), rngs=nnx.Rngs(0)), steps=1024),
    "mlp": Workload("mlp", (784,), 256,
                    lambda: models.MLP((784,), 10, hidden=(1024, 1024), rngs=nnx.Rngs(0)),
                    _dense_flops((784, 1024, 1024, 10)), steps=48),
    "cnn": Workload("cnn", (32, 32, 3), 128,
                    lambda: models.CNN((32, 32, 3), 10, rngs=nnx.Rngs(0)), steps=24),
    "digits": Workload("digits", (8, 8, 1), 128,
                       lambda: models.CNN((8, 8, 1), 10, rngs=nnx.Rngs(0)), steps=128),
    "gpt": Workload("gpt", (GPT_SEQ + 1,), 32, _gpt, _gpt_flops(), steps=16, task="lm"),
    "gpt-wide": Workload("gpt-wide", (WIDE_SEQ + 1,), 8, _gpt_wide, steps=8, task="lm"),
    # Common downsampling a user's conv net may have (`PoolCNN`).
    **{f"cnn-{pool}": Workload(f"cnn-{pool}", (32, 32, 3), 128, _pool_cnn(pool),
                               steps=24 if pool in ("avg", "max3") else 48)
       for pool in ("avg", "max3", "strided", "gap")},
}


def synthetic(w: Workload, batch_size: int, n_batches: int = 8):
    rng = np.random.default_rng(0)
    n = batch_size * n_batches
    if w.task == "lm":  # random bytes, every window full length
        x = rng.integers(0, 256, (n,) + w.input_shape).astype(np.uint8)
        return x, np.full(n, w.input_shape[0], np.int32)
    x = rng.normal(size=(n,) + w.input_shape).astype(np.float32)
    return x, rng.integers(0, 10, n).astype(np.int32)
