"""The user's loss or model raising on the examples (a model made for other
features, a loss that reads a key the examples do not hold) is one line that
names the user's line, before the first step, through the Python API and the
CLI; an error of dpax's own is not put on the user."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
import dpax.training.step
from conftest import check_loss_cli
from dpax.errors import FailsOnExamples


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l(x)


# Where a batch of other features fails: the line of `Net.__call__`'s body.
MODEL_LINE = f"test_blame.py:{Net.__call__.__code__.co_firstlineno + 1} (__call__)"


def ce(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def reads_image(model, batch):
    return ce(model, {**batch, "x": batch["image"]})


def fit(loss, features=8, n=2):
    t = dpax.Trainer(Net(nnx.Rngs(0)), loss, optax.sgd(0.1), devices=n)
    before = t.params
    x = np.zeros((32, features), np.float32)
    with pytest.raises(FailsOnExamples) as e:
        t.fit(x, np.zeros(32, np.int32), batch_size=16, until_step=1, log_every=10**9)
    assert int(t.state.step) == 0  # nothing trained, nothing changed
    jax.tree.map(np.testing.assert_array_equal, before, t.params)
    assert "\n" not in str(e.value)
    return e.value


@pytest.mark.parametrize("n", [1, 2])
def test_a_model_made_for_other_features_names_its_line_and_the_batch(n):
    error = fit(ce, features=10, n=n)
    assert MODEL_LINE in error.where
    assert "x (10,) float32, y () int32" in str(error)
    assert isinstance(error.__cause__, TypeError)  # JAX's own error, with its traceback


def test_a_loss_that_reads_a_key_the_examples_do_not_hold_names_it():
    error = fit(reads_image)
    assert "looks up 'image'" in str(error) and "(reads_image)" in error.where
    assert "they hold x (8,) float32, y () int32; dpax adds mask and index" in str(error)


def test_what_jax_cannot_trace_keeps_jax_own_error():
    """A Python `if` on a traced value: the code is the cause, not the
    examples, and JAX's message explains it in more than one line."""
    def branches(model, batch):
        return ce(model, batch) if batch["x"].sum() > 0 else ce(model, batch) * 2

    t = dpax.Trainer(Net(nnx.Rngs(0)), branches, optax.sgd(0.1), devices=2)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        t.fit(np.zeros((32, 8), np.float32), np.zeros(32, np.int32), batch_size=16,
              until_step=1, log_every=10**9)


def test_an_error_of_dpax_own_is_not_put_on_the_user(monkeypatch):
    """A failure inside dpax's own code keeps its own type and traceback."""
    monkeypatch.setattr(dpax.training.step, "shard_sums", dpax.training.step._step_key)
    t = dpax.Trainer(Net(nnx.Rngs(0)), ce, optax.sgd(0.1), devices=2)
    with pytest.raises(TypeError):
        t.fit(np.zeros((32, 8), np.float32), np.zeros(32, np.int32), batch_size=16,
              until_step=1, log_every=10**9)


def test_evaluate_and_predict_say_the_same():
    t = dpax.Trainer(Net(nnx.Rngs(0)), ce, optax.sgd(0.1), devices=2,
                     predict_fn=lambda model, batch: model(batch["x"]))
    x, y = np.zeros((32, 10), np.float32), np.zeros(32, np.int32)
    with pytest.raises(FailsOnExamples, match="x \\(10,\\) float32"):
        t.evaluate(x, y, batch_size=16)
    named = f"`predict_fn` or the model .*{re.escape(MODEL_LINE)}"
    with pytest.raises(FailsOnExamples, match=named):
        t.predict(x, batch_size=16)
    # A predict step's batch holds no index: the message does not say it does.
    t = dpax.Trainer(Net(nnx.Rngs(0)), ce, optax.sgd(0.1), devices=2,
                     predict_fn=lambda model, batch: model(batch["x"])[:, 0] + batch["index"])
    with pytest.raises(FailsOnExamples, match="looks up 'index'.*; dpax adds mask\\)"):
        t.predict(np.zeros((32, 8), np.float32), batch_size=16)


def test_through_the_cli_it_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    assert check_loss_cli(tmp_path, monkeypatch, "keylosses:reads_image", (
        "import optax\n\n\n"
        "def reads_image(model, batch):\n"
        "    logits = model(batch['image'])\n"
        "    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])\n")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "looks up 'image'" in err and "keylosses.py:5 (reads_image)" in err


def test_dpax_predict_fn_checks_that_the_model_takes_the_examples():
    """`dpax.classification_predict` declares what it reads, as the losses
    do: a model made for other features is `BadExamples` before a step."""
    t = dpax.Trainer(nnx.Linear(8, 3, rngs=nnx.Rngs(0)), dpax.classification_loss,
                     optax.sgd(0.1), devices=2, predict_fn=dpax.classification_predict)
    with pytest.raises(dpax.errors.BadExamples, match="the model cannot take `data`"):
        t.predict(np.zeros((32, 10), np.float32), batch_size=16)
    with pytest.raises(dpax.errors.BadExamples, match="reads the keys 'x'"):
        t.predict({"image": np.zeros((32, 8), np.float32)}, batch_size=16)
