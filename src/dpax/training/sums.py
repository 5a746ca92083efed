"""A shard's masked sums: what the per-device step adds up of `loss_fn`'s
per-example losses, metrics and weights, and the typed metrics they make.

Sums, not means: the sums and the count are all-reduced together and divided
once, which is the global-batch mean exactly, even when shards hold different
numbers of real examples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpax.errors import DpaxError, NotPerExample
from dpax.training.metrics import Count, Mean, Total

# loss_fn(model, batch) -> per-example losses, or (losses, {name: per-example values}),
# or (losses, metrics, per-example weights): then the loss and the metrics are
# weighted means, sum(w * l) / sum(w) over the global batch (e.g. w = real tokens).
LossFn = Callable[[nnx.Module, dict], Any]


def losses_and_metrics(loss_fn: LossFn, model, batch):
    """(losses, metrics, weights or None) from whatever `loss_fn` returns."""
    out = loss_fn(model, batch)
    if not isinstance(out, tuple):
        out = (out,)
    if not 1 <= len(out) <= 3:
        raise DpaxError(f"loss_fn must return losses, (losses, metrics) or (losses, metrics, "
                         f"weights), got a tuple of {len(out)}")
    losses, metrics, weights = out + ({}, None)[len(out) - 1:]
    if metrics is not None and not isinstance(metrics, Mapping):
        raise DpaxError(f"loss_fn's metrics must be a dict of per-example values, got "
                        f"{type(metrics).__name__}")
    return losses, _flat(metrics or {}), weights


def _flat(metrics: Mapping, prefix: str = "") -> dict:
    """Nested metrics as one dict, their names joined by "/" ("parts/ce")."""
    out = {}
    for k, v in metrics.items():
        for name, value in (_flat(v, f"{prefix}{k}/") if isinstance(v, Mapping)
                            else {f"{prefix}{k}": v}).items():
            if name in out:
                raise DpaxError(f"loss_fn's metrics name {name!r} twice (nested names join "
                                "by '/'): rename one")
            out[name] = value
    return out


def masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over the real rows of the batch axis; trailing axes are kept, so a
    per-example vector (say a one-hot of the class) sums to a histogram."""
    mask = mask.reshape(mask.shape + (1,) * (values.ndim - 1))
    # `where`, not multiply: a NaN on a padded row must not leak into the sum.
    return jnp.sum(jnp.where(mask, values.astype(jnp.float32), 0.0), axis=0)


EXAMPLES = "_examples"  # the example count among the sums, when losses are weighted


def shard_sums(loss_fn: LossFn, model, batch, differentiated: bool = True):
    """(weighted loss sum, weight sum, {metric: weighted sum}) over the real
    rows of a shard; the weight of an example is 1 unless `loss_fn` gives one.
    With weights, `sums` also holds the example count as "examples".
    `differentiated`: the loss is trained on, so it must be real floats."""
    losses, metrics, weights = losses_and_metrics(loss_fn, model, batch)
    mask = batch["mask"]
    for name, v in (("loss", losses), ("weight", weights)):
        if v is not None and jnp.shape(v) != mask.shape:  # a mean would break exactness
            raise NotPerExample(
                f"loss_fn must return one {name} per example (shape {mask.shape} for a "
                f"device's rows), got {jnp.shape(v)}; return per-example values before "
                "taking the mean", name, jnp.shape(v))
    for name, v in metrics.items():
        if not hasattr(v, "shape"):  # None, a tuple, a Python number
            raise DpaxError(f"loss_fn's metric {name!r} must be an array of per-example "
                            f"values, got {type(v).__name__}")
        if jnp.shape(v)[:1] != mask.shape:  # a mean over the shard, or no rows at all
            raise NotPerExample(
                f"loss_fn's metric {name!r} must hold one value per example (shape "
                f"{mask.shape} for a device's rows), got {jnp.shape(v)}; return per-example "
                "values (e.g. (pred == y).astype(float)): dpax takes their mean over the "
                "global batch", f"metric {name}", jnp.shape(v))
    if differentiated and not jnp.issubdtype(jnp.result_type(losses), jnp.floating):
        # Cast to float32 for the sums, an integer loss would train with a gradient of 0.
        raise DpaxError(
            f"loss_fn must return real floating-point losses, got {jnp.result_type(losses)}: "
            "an integer, boolean or complex loss has no gradient to train on; return a "
            "differentiable loss and report such a count as a metric")
    ones = jnp.ones(mask.shape, jnp.float32)
    w = None if weights is None else weights.astype(jnp.float32)

    def weighted(v):
        v = v.astype(jnp.float32)
        return v if w is None else v * w.reshape(w.shape + (1,) * (v.ndim - 1))

    # The loss, the weights (the count) and every per-example scalar metric in
    # ONE masked reduction: on a small model each separate reduction is a
    # kernel launch that costs as much as its math.
    scalar = [k for k, v in metrics.items() if jnp.shape(v) == mask.shape]
    cols = [weighted(losses), ones if w is None else w] + [weighted(metrics[k]) for k in scalar]
    if w is not None:
        cols.append(ones)
    totals = masked_sum(jnp.stack(cols, axis=1), mask)
    sums = {k: totals[2 + i] for i, k in enumerate(scalar)}
    sums.update({k: masked_sum(weighted(v), mask) for k, v in metrics.items()
                 if k not in scalar})
    if w is not None:
        sums[EXAMPLES] = totals[-1]
    return totals[0], totals[1], sums


def example_metrics(loss_sum, count, sums: dict) -> dict:
    """The loss and every loss_fn metric as means over the examples counted
    (weighted means when the loss gave weights: then `count` is the weight
    sum, reported as "weight", and "examples" counts the examples)."""
    sums = dict(sums)
    if EXAMPLES in sums:
        out = {"examples": Count(sums.pop(EXAMPLES)), "weight": Total(count)}
    else:
        out = {"examples": Count(count)}
    return {"loss": Mean(loss_sum, count), **out,
            **{k: Mean(v, count) for k, v in sums.items()}}
