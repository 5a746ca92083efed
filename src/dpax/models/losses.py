"""Per-example losses for ONE device's shard.

A dpax loss returns one loss per example (and optionally per-example metrics);
dpax masks, sums and all-reduces them, so the result is the global-batch mean
whatever the shard sizes are. Returning a per-device mean instead would weight
uneven shards wrongly; that is why the contract is per example.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import optax

from dpax.data import checks


def check_classification(ex: checks.Examples) -> None:
    """`classification_loss`'s examples: inputs `x`, and under `y` one class id
    per example, an integer below the model's number of outputs, or a bool
    (ids 0 and 1: a model of at least 2 outputs)."""
    reader = "dpax.classification_loss"
    checks.has_keys(ex, ("x", "y"), reader)
    out = ex.output_shape("x")
    classes = out[-1] if out else None

    def bound(high):
        has = (f"{classes} outputs (class ids 0..{classes - 1})" if classes > 1
               else f"{classes} output (class id 0)")
        return f"the model has {has}; relabel, or give the model {high + 1} outputs"

    checks.ids(ex, "y", ndim=1, below=classes, what="class ids", reader=reader,
               per_example="one class id per example", bound=bound)


@checks.declare(check_classification)
def classification_loss(model, batch):
    """Softmax cross-entropy and accuracy, per example; `y` holds class ids,
    integers (bools are ids 0 and 1).

    A `loss_fn` for `dpax.Trainer`. Before the first step the Trainer checks
    the examples by `check_classification` and raises `BadExamples` (a
    `DpaxError`) for a missing `y` or a class id the model has no output for.

    Args:
      model: the model, called on `batch["x"]`: one logit per class.
      batch: one device's shard of the batch, with `x` and `y`.

    Returns:
      `(losses, {"accuracy": correct})`: arrays of one float per example.
    """
    logits = model(batch["x"]).astype(jnp.float32)
    y = batch["y"]
    if y.dtype == jnp.bool_:  # optax takes integer ids only
        y = y.astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return loss, {"accuracy": correct}


def check_regression(ex: checks.Examples) -> None:
    """`regression_loss`'s examples: inputs `x`, and under `y` as many numbers
    per example as the model outputs."""
    reader = "dpax.regression_loss"
    checks.has_keys(ex, ("x", "y"), reader)
    out = ex.output_shape("x")
    if out is not None:
        checks.per_example_size(ex, "y", math.prod(out), reader, "the model outputs")


@checks.declare(check_regression)
def regression_loss(model, batch):
    """Squared error per example (the mean squared error before the mean).

    A `loss_fn` for `dpax.Trainer`. Before the first step the Trainer checks
    the examples by `check_regression` and raises `BadExamples` (a
    `DpaxError`) for a missing `y` or one whose size per example is not the
    model's output's.

    Args:
      model: the model, called on `batch["x"]`.
      batch: one device's shard of the batch, with `x` and `y`.

    Returns:
      `(losses, {})`: each example's squared error, the mean over its
      outputs where `y` has several (`(B, k)`, `(B, 1)`): over the batch,
      the mean squared error of every output.
    """
    y = batch["y"]
    pred = model(batch["x"]).astype(jnp.float32).reshape(y.shape)
    return jnp.square(pred - y).reshape(y.shape[0], -1).mean(-1), {}


def check_inputs(ex: checks.Examples) -> None:
    """The examples of dpax's `predict_fn`s: inputs `x` the model takes."""
    checks.has_keys(ex, ("x",), "dpax's predict_fn")
    ex.output_shape("x")


@checks.declare(check_inputs)
def classification_predict(model, batch):
    """The most likely class of each example.

    A `predict_fn` for `dpax.Trainer`.

    Args:
      model: the model, called on `batch["x"]`: one logit per class.
      batch: one device's shard of the batch, with `x`.

    Returns:
      The class ids, one integer per example.
    """
    return jnp.argmax(model(batch["x"]), -1)


@checks.declare(check_inputs)
def regression_predict(model, batch):
    """The model's output for each example, as `regression_loss` reads it.

    A `predict_fn` for `dpax.Trainer`.

    Args:
      model: the model, called on `batch["x"]`.
      batch: one device's shard of the batch, with `x`.

    Returns:
      One float per example where the model has one output, else each
      example's outputs (`(B, k)`).
    """
    out = model(batch["x"])
    n = batch["x"].shape[0]
    return out.reshape(n) if out.size == n else out.reshape(n, -1)


def check_lm(ex: checks.Examples) -> None:
    """`lm_loss`'s examples: under `x` windows of token ids below the model's
    vocabulary, under `y` how many of each window's tokens are real."""
    reader = "dpax.lm_loss"
    checks.has_keys(ex, ("x", "y"), reader)
    x = ex.arrays["x"]
    vocab = None
    if x.ndim == 2:  # the model reads all but a window's last token
        out = ex.output_shape("x", (x.shape[1] - 1,))
        vocab = out[-1] if out else None
    checks.ids(ex, "x", ndim=2, below=vocab, what="token ids", reader=reader,
               per_example="a window of seq_len + 1 token ids per example",
               bound=lambda high: f"the model's vocabulary has {vocab} tokens")
    if ex.arrays["y"].ndim == 2:  # packed windows: a segment id per token
        checks.ids(ex, "y", ndim=2, below=x.shape[1] + 1, what="segment ids", reader=reader,
                   per_example="a segment id per token of its window",
                   bound=lambda high: f"a window holds {x.shape[1]} tokens")
        return
    checks.ids(ex, "y", ndim=1, below=x.shape[1] + 1, what="window lengths", reader=reader,
               per_example="one length per window",
               bound=lambda high: f"a window holds {x.shape[1]} tokens")


@checks.declare(check_lm)
def lm_loss(model, batch, token_bytes=None):
    """Next-token cross-entropy of text windows (`dpax.data.text`): `x` holds
    seq_len + 1 tokens, `y` how many are real. Per window: the mean over its
    real targets, weighted by their number, so dpax's mean is over tokens (a
    short, padded window counts by its tokens), with next-token accuracy.
    With `token_bytes` (the bytes each token id stands for: a BPE's), also
    the bytes per token of its targets, which bits per byte divide by.

    A `loss_fn` for `dpax.Trainer`. Before the first step the Trainer checks
    the examples by `check_lm` and raises `BadExamples` (a `DpaxError`) for
    a token id outside the model's vocabulary or a length longer than its
    window.

    Args:
      model: the language model, called on each window's first seq_len
        tokens: logits over the vocabulary at every position.
      batch: one device's shard of the batch: `x` [windows, seq_len + 1]
        token ids, `y` each window's number of real tokens, or for packed
        windows each token's segment id (0: padding), which the model is
        called with too (`model(tokens, segments)`).
      token_bytes: a sequence of each token id's length in bytes, or None.

    Returns:
      `(losses, metrics, weights)`: per window, the mean loss over its real
      targets, the metrics `accuracy` (and `bytes_per_token` with
      `token_bytes`) as such means, and the number of real targets, which
      weighs the window in dpax's mean.
    """
    tokens, length = batch["x"], batch["y"]
    targets = tokens[:, 1:].astype(jnp.int32)
    if length.ndim == 2:  # packed: a target counts when its input is of its piece
        segments = length
        logits = model(tokens[:, :-1], segments[:, :-1]).astype(jnp.float32)
        real = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    else:
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        real = jnp.arange(targets.shape[1]) < (length[:, None] - 1)
    n = jnp.sum(real, axis=1)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets)

    def mean(v):  # over a window's real targets; 0 for a window with none
        return jnp.sum(jnp.where(real, v, 0.0), axis=1) / jnp.maximum(n, 1)

    metrics = {"accuracy": mean(correct.astype(jnp.float32))}
    if token_bytes is not None:
        metrics["bytes_per_token"] = mean(jnp.asarray(token_bytes, jnp.float32)[targets])
    return mean(per_token), metrics, n


def lm_predict(model, batch):
    """The most likely next token at every position of each window.

    A `predict_fn` for `dpax.Trainer`.

    Args:
      model: the language model (as for `lm_loss`).
      batch: one device's shard of the batch, with `x` as for `lm_loss`.

    Returns:
      Token ids, [windows, seq_len].
    """
    return jnp.argmax(model(batch["x"][:, :-1]), -1)


def for_task(task: str, token_bytes=None):
    """The built-in (loss_fn, predict_fn) for a dataset's task (`token_bytes`:
    a BPE tokenizer's, for text)."""
    if task == "classification":
        return classification_loss, classification_predict
    if task == "lm":
        if token_bytes is None:
            return lm_loss, lm_predict
        return functools.partial(lm_loss, token_bytes=tuple(int(b) for b in token_bytes)), \
            lm_predict
    return regression_loss, regression_predict
