"""The benchmark workloads: models and synthetic data of fixed shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from flax import nnx

from dpax import models


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    input_shape: tuple[int, ...]
    batch_size: int
    make: Callable[[], nnx.Module]
    flops_per_example: float | None = None  # forward + backward, for FLOP/s
    steps: int = 48  # per timed repeat: ~0.1-2 s, so scheduling noise averages out


def _dense_flops(sizes):
    return 6.0 * sum(a * b for a, b in zip(sizes, sizes[1:]))  # 2 forward + 4 backward


# Steps per repeat are multiples of 8, so --steps-per-call 8 runs whole calls only.
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
}


def synthetic(w: Workload, batch_size: int, n_batches: int = 8):
    rng = np.random.default_rng(0)
    n = batch_size * n_batches
    x = rng.normal(size=(n,) + w.input_shape).astype(np.float32)
    return x, rng.integers(0, 10, n).astype(np.int32)
