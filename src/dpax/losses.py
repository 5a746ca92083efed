"""Per-example losses for ONE device's shard.

A dpax loss returns one loss per example (and optionally per-example metrics);
dpax masks, sums and all-reduces them, so the result is the global-batch mean
whatever the shard sizes are. Returning a per-device mean instead would weight
uneven shards wrongly; that is why the contract is per example.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def classification_loss(model, batch):
    """Softmax cross-entropy and accuracy, per example."""
    logits = model(batch["x"]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    return loss, {"accuracy": correct}


def regression_loss(model, batch):
    """Squared error per example (seed 000's mean squared error, before the mean)."""
    pred = model(batch["x"]).astype(jnp.float32).reshape(batch["y"].shape)
    return jnp.square(pred - batch["y"]), {}


def classification_predict(model, batch):
    return jnp.argmax(model(batch["x"]), -1)


def regression_predict(model, batch):
    return model(batch["x"]).reshape(batch["x"].shape[0])


def for_task(task: str):
    """The built-in (loss_fn, predict_fn) for a dataset's task."""
    if task == "classification":
        return classification_loss, classification_predict
    return regression_loss, regression_predict
