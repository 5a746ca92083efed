"""What the Trainer checks before the first step (`dpax.data.checks`, the
losses' rules in `dpax.models.losses`): each bad input is its `DpaxError`
subclass, naming the argument, through `fit`, `fit_stream`, `evaluate` and
`predict`, with nothing compiled; legal inputs of unusual shapes still
train; and `TooManyBadSteps` says what was not finite."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import digits, leaves, max_diff, mlp_trainer, small_mlp
from dpax.data import checks, pipeline, sources
from dpax.data.pipeline import BatchPlan
from dpax.errors import BadArgument, BadExamples, BadLabels, NotFinite
from dpax.parallel import distributed

N = 2  # devices: every refusal below happens before any of them runs a step


def data(n=64):
    ds = digits()
    return ds.x_train[:n].copy(), ds.y_train[:n].copy()


def nan_x():
    x, y = data()
    x[5, 3, 3, 0] = np.nan
    x[9, 0, 0, 0] = np.inf
    return x, y


def label(change):
    x, y = data()
    return x, change(y)


BAD = {  # name: ((x, y), the exception, its message ({x}, {y}: how it names them))
    "labels past the outputs": (label(lambda y: y + 10), BadLabels,
                                "{y} holds class ids up to 19, but the model has 10 outputs"),
    "negative labels": (label(lambda y: y - 1), BadLabels, "{y} holds class ids below 0 "
                        "(the least is -1)"),
    "float labels": (label(lambda y: y.astype(np.float32)), BadLabels,
                     "{y} holds float32 values, but dpax.classification_loss takes integer "
                     "class ids; these are whole numbers: give `y.astype(np.int32)`"),
    "one-hot labels": (label(lambda y: np.eye(10, dtype=np.float32)[y]), BadLabels,
                       "these rows look one-hot: give `y.argmax(-1)`"),
    "labels per pixel": (label(lambda y: np.stack([y, y], 1)), BadLabels,
                         "{y} has shape (64, 2), but dpax.classification_loss takes one class "
                         "id per example"),
    "nan in x": (nan_x(), NotFinite, "{x} contains NaN or infinite values in 2 of its 64 "
                 "examples (the first at row 5); clean the data first"),
    "complex x": ((data()[0] + 1j, data()[1]), BadExamples, "{x} is complex (complex64)"),
    "x the model cannot take": ((data()[0][:, :4], data()[1]), BadExamples,
                                "the model cannot take {x}: examples of shape (4, 8, 1) and "
                                "dtype float32 (TypeError: "),
    "strings": (label(lambda y: y.astype(str)), BadExamples, "{y} has non-numeric dtype <U"),
}
STRUCTURE = {  # checked on every batch of a stream: no "first batch"
    "unequal lengths": ((data()[0], data()[1][:50]), "the arrays differ in length: {y} has 50 "
                        "rows, {x} 64; every array needs one row per example"),
    "empty": ((data()[0][:0], data()[1][:0]), "no examples: {all} has 0 rows"),
    "a list": ((data()[0], list(data()[1])), "{y} is a list; give an array"),
}
NAMES = {"fit_stream": {"x": "`batches`['x']", "y": "`batches`['y']", "all": "`batches`"},
         "fit": {"x": "`data`", "y": "`y`", "all": "`data`"}}
NAMES["evaluate"] = NAMES["check"] = NAMES["fit"]


def nothing_ran(t):
    return t.step == 0 and sum(t.traces.values()) == 0


def call(t, how, x, y, batch_size=16):
    if how == "fit":
        t.fit(x, y, batch_size=batch_size, until_step=4)
    elif how == "fit_stream":
        t.fit_stream(iter([{"x": x, "y": y}] * 3))
    elif how == "evaluate":
        t.evaluate(x, y, batch_size=batch_size)
    elif how == "check":  # the checks alone
        t.check(x, y, batch_size=batch_size)
    else:
        t.predict(x, batch_size=batch_size)


@pytest.mark.parametrize("how", ["fit", "fit_stream", "evaluate", "check"])
@pytest.mark.parametrize("case", list(BAD) + list(STRUCTURE))
def test_bad_examples_are_refused_before_any_step(case, how):
    if case in BAD:
        (x, y), error, message = BAD[case]
    else:
        ((x, y), message), error = STRUCTURE[case], BadExamples
    names = NAMES[how]
    if how == "fit_stream" and case in BAD:  # values: the first batch's
        names = {k: "the first batch of " + v for k, v in names.items()}
    t = mlp_trainer(N, predict_fn=dpax.classification_predict)
    with pytest.raises(error) as e:
        call(t, how, x, y)
    assert message.format(**names) in str(e.value), str(e.value)
    of_x = case in ("nan in x", "complex x", "empty", "x the model cannot take")
    assert e.value.argument == ("batches" if how == "fit_stream" else
                                "data" if of_x else "y"), e.value.argument
    assert "\n" not in str(e.value) and nothing_ran(t)


@pytest.mark.parametrize("case", ["nan in x", "complex x"])
def test_predict_checks_its_inputs(case):
    (x, _), error, message = BAD[case]
    t = mlp_trainer(N, predict_fn=dpax.classification_predict)
    with pytest.raises(error) as e:
        t.predict(x)
    assert message.format(x="`data`") in str(e.value) and nothing_ran(t)


@pytest.mark.parametrize("how", ["fit", "evaluate", "predict", "check"])
@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_a_batch_size_below_one_is_named(how, size):
    x, y = data()
    t = mlp_trainer(N, predict_fn=dpax.classification_predict)
    with pytest.raises(BadArgument, match=r"`batch_size` must be a whole number >= 1") as e:
        call(t, how, x, y, batch_size=size)
    assert e.value.argument == "batch_size" and nothing_ran(t)


def test_a_dict_without_the_keys_the_loss_reads_is_named():
    x, y = data()
    t = mlp_trainer(N)
    with pytest.raises(BadExamples, match=r"classification_loss reads the keys 'x', 'y' of "
                                          r"each batch; `data` has 'image', 'y'"):
        t.fit({"image": x, "y": y}, batch_size=16, until_step=2)
    with pytest.raises(NotFinite, match=r"`data`\['w'\]\['a'\] contains NaN"):
        t.fit({"x": x, "y": y, "w": {"a": np.full(len(y), np.nan)}}, batch_size=16,
              until_step=2)
    assert nothing_ran(t)


def test_batches_given_to_fit_are_checked_on_their_first():
    """`fit(batches=...)`: the data is checked whole, the batches (its
    batches, by contract: here made of other labels) on the first, named
    as the data they stand for (the CLI's come from `--data`)."""
    x, y = data()
    t = mlp_trainer(N)
    plan = BatchPlan(len(x), 16, seed=0)
    rows = t.backend.local_rows(t.padded(16))
    bad = pipeline.train_input({"x": x, "y": y + 20}, plan, rows, 0, 4)
    with pytest.raises(BadLabels, match=r"the first batch of `y` holds class ids up to 2\d, "
                                        r"but the model has 10 outputs"):
        t.fit(x, y, batch_size=16, until_step=4, batches=bad)
    assert nothing_ran(t)


class Reads(sources.ArrayTable):
    """A table that counts the rows read from it."""

    def __init__(self, x):
        super().__init__(x, "counted")
        self.rows = 0

    def read(self, idx):
        self.rows += len(idx)
        return super().read(idx)


@pytest.mark.parametrize("how", ["fit", "evaluate", "predict", "check"])
def test_columns_read_per_batch_are_checked_on_their_first_batch_only(how, monkeypatch):
    """Inputs on disk are not read whole to be checked: a NaN in the first
    batch is refused when that batch is read, before the step. One process
    agrees with no one: no collective (test_multiprocess.py has two)."""
    monkeypatch.setattr(distributed, "least", lambda value: pytest.fail("a collective"))
    rng = np.random.default_rng(0)
    x = rng.random((400, 4096)).astype(np.float32)  # a batch over 1 MB: one batch per read
    x[:, 7] = np.nan
    table = Reads(x)
    model = dpax.models.MLP((4096,), 10, hidden=8, rngs=nnx.Rngs(0))
    t = dpax.Trainer(model, dpax.classification_loss, optax.sgd(0.1), devices=N,
                     predict_fn=dpax.classification_predict)
    with pytest.raises(NotFinite, match=r"the first batch of `data` contains NaN or infinite "
                                        r"values in 100 of its 100 examples"):
        call(t, how, sources.Column(table), rng.integers(0, 10, 400), batch_size=100)
    assert table.rows == 100 and nothing_ran(t)



def test_bool_labels_need_a_model_of_two_outputs():
    """A bool label is class id 0 or 1: a model of one output has no output
    for True (its loss is NaN). Refused by the dtype, whatever the values,
    as the int labels of the same ids are by theirs."""
    x, y = data()
    model = dpax.models.MLP(x.shape[1:], 1, hidden=8, rngs=nnx.Rngs(0))
    t = dpax.Trainer(model, dpax.classification_loss, optax.sgd(0.1), devices=N)
    fix = re.escape("the model has 1 output (class id 0); relabel, or give the model 2 outputs")
    with pytest.raises(BadLabels, match=r"`y` holds class ids up to 1, but " + fix):
        t.fit(x, (y % 2).astype(np.int32), batch_size=16, until_step=2)  # the reference
    for labels in (y % 2 == 1, np.zeros(len(y), bool)):
        with pytest.raises(BadLabels, match=r"`y` holds bools, class ids 0 and 1, but " + fix):
            t.fit(x, labels, batch_size=16, until_step=2)
    assert nothing_ran(t)

# -- legal input of unusual kinds still trains ------------------------------------------
def fit_steps(t, x, y, steps=3):
    t.fit(x, y, batch_size=24, until_step=steps, log_every=steps)
    return leaves(t)


@pytest.mark.slow
def test_labels_of_any_integer_dtype_or_bool_train_as_int32_labels():
    x, y = data(200)
    ref = fit_steps(mlp_trainer(N), x, y)
    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.int64):
        assert max_diff(fit_steps(mlp_trainer(N), x, y.astype(dtype)), ref) == 0, dtype
    binary = y % 2 == 1
    ref = fit_steps(mlp_trainer(N), x, binary.astype(np.int32))
    assert max_diff(fit_steps(mlp_trainer(N), x, binary), ref) == 0


def test_uint8_images_several_keys_and_a_loss_of_ones_own_train():
    x, y = data(200)
    t = mlp_trainer(N)
    t.fit((x * 16).astype(np.uint8), y, batch_size=24, until_step=2)
    assert t.step == 2
    extra = {"x": x, "y": y, "id": np.arange(200), "weights": {"w": np.ones(200, np.float32)}}
    t.fit(extra, batch_size=24, until_step=4)
    assert t.step == 4

    def soft_targets(model, batch):  # float targets: no class-id rule applies
        return optax.softmax_cross_entropy(model(batch["x"]), batch["p"])

    own = dpax.Trainer(small_mlp(), soft_targets, optax.sgd(0.1), devices=N)
    own.fit({"x": x, "p": np.eye(10, dtype=np.float32)[y] * 0.9 + 0.01}, batch_size=24,
            until_step=2)
    assert own.step == 2 and all(np.isfinite(a).all() for a in leaves(own))


def test_regression_targets_match_the_models_outputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    model = dpax.make_model("linear", (5,), 1, seed=0, task="regression")
    t = dpax.Trainer(model, dpax.regression_loss, optax.sgd(0.1), devices=N)
    with pytest.raises(BadLabels, match=r"`y` has 3 value\(s\) per example \(shape \(64, 3\)\), "
                                        r"but the model outputs 1"):
        t.fit(x, rng.normal(size=(64, 3)).astype(np.float32), batch_size=16, until_step=2)
    assert nothing_ran(t)
    t.fit(x, rng.normal(size=64).astype(np.int32), batch_size=16, until_step=2)  # numbers
    assert t.step == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_regression_takes_several_outputs_and_a_column_of_one(seed):
    """`y` of shape (B, 2) trains the mean squared error over every output
    (each example's mean over its outputs, then dpax's over the batch), on
    one device and on N; `y` of shape (B, 1) trains what `y` of shape (B,)
    does. Both were refused as not one loss per example."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(30, 4)).astype(np.float32)
    y2 = rng.normal(size=(30, 2)).astype(np.float32)

    def trained(loss, y, outputs, n):
        t = dpax.Trainer(nnx.Linear(4, outputs, rngs=nnx.Rngs(seed)), loss, optax.adam(0.05),
                         devices=n)
        t.fit(x, y, batch_size=15, until_step=3, log_every=10**9)
        return t.params

    def by_hand(model, batch):
        return jax.numpy.square(model(batch["x"]) - batch["y"]).mean(-1)

    reference = trained(by_hand, y2, 2, 1)
    for n in (1, N):
        assert max_diff(reference, trained(dpax.regression_loss, y2, 2, n)) < 1e-6, n
    column = trained(dpax.regression_loss, y2[:, :1], 1, 1)
    assert max_diff(column, trained(dpax.regression_loss, y2[:, 0], 1, 1)) < 1e-7


def test_the_models_outputs_are_traced_once_per_input_shape(monkeypatch):
    x, y = data()
    t = mlp_trainer(N, predict_fn=dpax.classification_predict)
    calls = []
    real = jax.eval_shape

    def counted(fn, *args):
        calls.append(getattr(fn, "__qualname__", ""))
        return real(fn, *args)

    monkeypatch.setattr(jax, "eval_shape", counted)
    t.fit(x, y, batch_size=16, until_step=2)
    t.evaluate(x, y)
    t.fit_stream(iter([{"x": x, "y": y}]))
    assert [c for c in calls if "_model_output" in c] == ["Trainer._model_output.<locals>.call"]


# -- TooManyBadSteps says what was found ----------------------------------------------------
def stream_then(bad_batch, **options):
    """A Trainer stopped by bad batches after a good first one (only the first
    of a stream is checked)."""
    x, y = data(32)
    t = mlp_trainer(N, max_bad_steps=2, **options)
    with pytest.raises(dpax.TooManyBadSteps) as e:
        t.fit_stream(iter([{"x": x, "y": y}] + [bad_batch(x, y)] * 3), log_every=1)
    finite = all(np.isfinite(a).all() for a in leaves(t))
    return e.value, finite


def labels_past_the_outputs(x, y):
    return {"x": x, "y": y + 10}


def nan_inputs(x, y):
    return {"x": np.full_like(x, np.nan), "y": y}


def test_bad_steps_applied_name_the_loss_and_the_params_as_they_are():
    # Labels past the model's outputs: a NaN loss, a finite gradient (no
    # output to push), so the params stay finite.
    e, finite = stream_then(labels_past_the_outputs)
    assert (e.loss_finite, e.gradient_finite, e.params_finite, e.skipped) == (
        False, None, True, False) and finite
    assert "applied (skip_nonfinite=False): the loss was not finite; the params are " \
           "finite. To go on, check the data" in str(e)
    e, finite = stream_then(nan_inputs)
    assert (e.loss_finite, e.params_finite) == (False, False) and not finite
    assert "the params are not finite. To go on, resume from the last checkpoint with " \
           "`skip_nonfinite=True`" in str(e)
    assert (e.steps, e.limit) == (2, 2) and "\n" not in str(e)


def test_bad_steps_skipped_name_the_gradient_or_the_loss():
    e, finite = stream_then(nan_inputs, skip_nonfinite=True)
    assert (e.loss_finite, e.gradient_finite, e.params_finite, e.skipped) == (
        None, False, True, True) and finite
    assert "were skipped: the gradient was not finite, or the batch weighed nothing; the " \
           "params are the last good ones" in str(e)
    e, finite = stream_then(labels_past_the_outputs, clip_norm=1.0, skip_nonfinite=True)
    assert (e.loss_finite, e.gradient_finite, e.params_finite) == (False, True, True)
    assert "were skipped: the loss was not finite" in str(e) and finite



@pytest.mark.parametrize("options", [{}, {"sharding": "full"}, {"backend": "pmap"}])
@pytest.mark.parametrize("bad,finite", [(nan_inputs, False), (labels_past_the_outputs, True)])
def test_the_params_are_checked_finite_on_the_devices(options, bad, finite, monkeypatch):
    """`params_finite` is one scalar reduced on the devices: no host copy of
    the params (under FSDP a gather); the host's reading after agrees."""
    x, y = data(32)
    t = mlp_trainer(N, max_bad_steps=2, **options)
    with monkeypatch.context() as m:
        m.setattr(dpax.Trainer, "params", property(
            lambda self: pytest.fail("the params were copied to the host")))
        with pytest.raises(dpax.TooManyBadSteps) as e:
            t.fit_stream(iter([{"x": x, "y": y}] + [bad(x, y)] * 3), log_every=1)
    assert e.value.params_finite is finite
    assert all(np.isfinite(a).all() for a in leaves(t)) is finite


def test_a_loss_declares_its_rule_through_partial():
    import functools

    assert checks.rule_of(functools.partial(dpax.lm_loss, token_bytes=(1,))) is \
        dpax.models.losses.check_lm
    assert checks.rule_of(lambda m, b: 0) is None
