"""The bench's hand loops do the per-step work dpax's built-in losses do: the
same mean loss and the same accuracy (`Workload.mean_loss` against
`dpax.models.losses`, weighted as dpax weighs them), so a bench row compares
like with like; the masked loop's loss (`Workload.masked_loss`) on a padded
batch is the unpadded batch's."""

import numpy as np
import pytest
from flax import nnx

from dpax.bench.workloads import WORKLOADS, synthetic


@pytest.mark.parametrize("name", ["tiny", "gpt"])  # a classifier, a language model
def test_hand_loss_and_accuracy_match_dpax_builtin_loss(name):
    w = WORKLOADS[name]
    x, y = synthetic(w, 64, 1)
    model = w.make()
    # Each compiled whole: op by op, the GPT's forward passes compiled ~80 programs.
    loss, accuracy = nnx.jit(w.mean_loss)(model, x, y)
    out = nnx.jit(w.loss())(model, {"x": x, "y": y})
    per, metrics = out[0], out[1]
    weights = np.asarray(out[2], np.float64) if len(out) > 2 else np.ones(len(x))
    mean = lambda v: np.sum(np.asarray(v, np.float64) * weights) / np.sum(weights)  # noqa: E731
    np.testing.assert_allclose(float(loss), mean(per), rtol=1e-5)
    np.testing.assert_allclose(float(accuracy), mean(metrics["accuracy"]), rtol=1e-6)
    assert 0.0 < float(accuracy) < 1.0  # an accuracy that can tell the two apart


@pytest.mark.parametrize("name", ["tiny", "gpt"])
def test_the_masked_loss_of_a_padded_batch_is_the_unpadded_batch_loss(name):
    """Against dpax's per-example loss on the 40 real rows, weighted as dpax
    weights it: windows of different lengths (weights 1..64 tokens), and
    padded rows that would count if the mask were ignored (copies of real
    rows, with their lengths)."""
    w = WORKLOADS[name]
    x, y = synthetic(w, 64, 1)
    if w.task == "lm":
        y = np.random.default_rng(1).integers(2, x.shape[1] + 1, len(x)).astype(np.int32)
    model = w.make()
    out = nnx.jit(w.loss())(model, {"x": x[:40], "y": y[:40]})
    weights = np.asarray(out[2], np.float64) if len(out) > 2 else np.ones(40)
    assert len(set(weights)) > 1 or w.task != "lm"  # the weighting is tested too
    mean = lambda v: np.sum(np.asarray(v, np.float64) * weights) / np.sum(weights)  # noqa: E731
    pad = lambda a: np.concatenate([a[:40], a[:24]])  # noqa: E731
    batch = {"x": pad(x), "y": pad(y), "mask": np.arange(64) < 40}
    loss, metrics = nnx.jit(w.masked_loss)(model, batch)
    np.testing.assert_allclose(float(loss), mean(out[0]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), mean(out[1]["accuracy"]), rtol=1e-5)
