"""Typed metrics: each value knows how it adds up over steps and batches.

A step returns `{name: Mean | Count | Total | Last}`. The type, not the name,
says how the host reduces it (clu's `metrics.py` idea):

  Mean   sum of per-example values and the examples counted: the mean over
         every real example since the last log (padding never counts)
  Count  examples counted (an int in the row)
  Total  summed over steps, e.g. the steps skipped for a non-finite loss
  Last   the latest step's value, e.g. the learning rate

On the device the running sums travel packed: every scalar in ONE float32
vector, because each output of a compiled call costs dispatch time. The host
takes over sums in float64 and computes the row at log boundaries only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Mean:
    total: Any  # sum of the per-example values over the real examples
    count: Any  # those examples

    adds = True

    def compute(self):
        count = float(self.count)
        return _scalar(self.total / count) if count else float("nan")


@struct.dataclass
class Total:
    value: Any

    adds = True

    def compute(self):
        return _scalar(self.value)


@struct.dataclass
class Count(Total):
    def compute(self):
        return int(self.value)


@struct.dataclass
class Last(Total):
    adds = False


METRIC_TYPES = (Mean, Count, Total, Last)


def is_metric(x) -> bool:
    return isinstance(x, METRIC_TYPES)


def _adds(metrics: dict) -> list[bool]:
    """Per leaf of `metrics`: whether it adds up over steps (else the latest wins)."""
    flags = jax.tree.map(lambda m: jax.tree.map(lambda _: m.adds, m), metrics, is_leaf=is_metric)
    return jax.tree.leaves(flags)


# -- on the device -------------------------------------------------------------------
def pack(metrics: dict) -> dict:
    """`{"scalars": f32 vector of every scalar leaf, "arrays": [other leaves]}`."""
    leaves = jax.tree.leaves(metrics)
    return {"scalars": jnp.stack([jnp.asarray(v, jnp.float32) for v in leaves if jnp.ndim(v) == 0]),
            "arrays": [v for v in leaves if jnp.ndim(v) != 0]}


def accumulate(metrics: dict, sums: dict) -> dict:
    """Packed `sums` with this step's `metrics` folded in (traced; `sums` was
    packed from a tree of the same types and shapes)."""
    new = pack(metrics)
    leaves, adds = jax.tree.leaves(metrics), _adds(metrics)
    scalar_adds = np.array([a for v, a in zip(leaves, adds) if jnp.ndim(v) == 0])
    array_adds = [a for v, a in zip(leaves, adds) if jnp.ndim(v) != 0]
    return {"scalars": jnp.where(scalar_adds, sums["scalars"] + new["scalars"], new["scalars"]),
            "arrays": [o + n if a else n
                       for o, n, a in zip(sums["arrays"], new["arrays"], array_adds)]}


# -- on the host ---------------------------------------------------------------------
class Packing:
    """How a tree of metrics is packed: from its shapes (`jax.eval_shape` of the
    step), so the host can unpack without tracing anything."""

    def __init__(self, shapes: dict):
        leaves, self.treedef = jax.tree.flatten(shapes)
        self.scalar = [len(s.shape) == 0 for s in leaves]
        self.shapes = leaves

    def zeros(self) -> dict:
        """Packed zero sums, on the host."""
        return {"scalars": np.zeros(sum(self.scalar), np.float32),
                "arrays": [np.zeros(s.shape, s.dtype) for s, k in zip(self.shapes, self.scalar)
                           if not k]}

    def unpack(self, packed: dict) -> dict:
        scalars, arrays = iter(np.asarray(packed["scalars"])), iter(packed["arrays"])
        leaves = [next(scalars) if k else np.asarray(next(arrays)) for k in self.scalar]
        return jax.tree.unflatten(self.treedef, leaves)


def reduce(trees: Sequence[dict]) -> dict:
    """One tree from the host sums of several chunks of steps, in float64:
    Mean, Count and Total add up; Last keeps the latest."""
    def combine(*ms):
        if not ms[0].adds:
            return ms[-1]
        return jax.tree.map(lambda *vs: np.stack([np.asarray(v) for v in vs]).sum(
            0, dtype=np.float64), *ms)

    return jax.tree.map(combine, *trees, is_leaf=is_metric)


def compute(metrics: dict) -> dict:
    """The log row: {name: value} (a mean is NaN over zero examples)."""
    return {name: m.compute() for name, m in metrics.items()}


def summarize(trees: Sequence[dict] | dict) -> dict:
    """`compute(reduce(trees))` of host metric trees."""
    return compute(reduce([trees] if isinstance(trees, dict) else list(trees)))


def _scalar(x):
    x = np.asarray(x)
    return float(x) if x.ndim == 0 else x
