"""State layouts (`dpax.parallel.layout`): ZeRO-1 and FSDP give one device's numbers
for any device count (their leaves padded to a multiple of N), hold 1/N of the
bytes, and checkpoint one logical copy that resumes in any layout."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import STEPS, digits, fit_digits, leaves, max_diff
from dpax.errors import DpaxError
from dpax.parallel import layout
from dpax.parallel.layout import Split
from dpax.training.state import init_state

BATCH = 61  # uneven for every N below
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.05, momentum=0.9),
              "adam": lambda: optax.adam(3e-3)}


def odd_mlp():
    # Hidden width 23: its layers' sizes (64*23, 23, 23*23, 23*10) divide none
    # of 3, 5 and 7, so every sharded leaf at those N is padded.
    ds = digits()
    return dpax.models.MLP(ds.input_shape, ds.n_out, hidden=23, rngs=nnx.Rngs(0))


def trainer(n, opt="sgd", **kw):
    return dpax.Trainer(odd_mlp(), dpax.classification_loss, OPTIMIZERS[opt](), devices=n, **kw)


@functools.cache
def one_device(opt, **kw):
    """(loss curve, params) of the replicated run on one device."""
    t = trainer(1, opt, **kw)
    return [r["loss"] for r in fit_digits(t, BATCH)], leaves(t)


def compare(t, opt, **kw):
    curve = [r["loss"] for r in fit_digits(t, BATCH)]
    ref_curve, ref = one_device(opt, **kw)
    rel = max(abs(a - b) / a for a, b in zip(ref_curve, curve))
    return max_diff(leaves(t), ref), rel


TUNED = pytest.mark.equivalence  # also run with the opt-in XLA:CPU tuning (make test-tuned)


@pytest.mark.parametrize("sharding,n,opt", [
    # No N = 4: it splits and pads each leaf as N = 8 does (64 rows evenly,
    # 23 and 10 padded), with SGD and Adam both run on 8. Each N keeps an
    # exact optimizer (SGD or momentum, held to a tenth of Adam's tolerance)
    # in the main tier, N = 3 in the test below; the slow tier adds SGD on 3
    # and 5, Adam on 1 and 2.
    ("full", 1, "sgd"), pytest.param("full", 1, "adam", marks=pytest.mark.slow),
    ("full", 2, "sgd"),
    pytest.param("full", 2, "adam", marks=pytest.mark.slow),
    pytest.param("full", 5, "sgd", marks=pytest.mark.slow), ("full", 5, "adam"),
    pytest.param("full", 3, "adam", marks=TUNED),
    pytest.param("full", 3, "sgd", marks=pytest.mark.slow),
    pytest.param("full", 8, "sgd", marks=TUNED), ("full", 8, "adam"),
    ("full", 7, "momentum"), ("full", 5, "momentum"),
    pytest.param("optimizer", 3, "adam", marks=TUNED), ("optimizer", 8, "momentum")])
def test_sharded_layouts_equal_one_device_for_any_n(sharding, n, opt):
    t = trainer(n, opt, sharding=sharding)
    diff, rel = compare(t, opt)
    print(f"{sharding} {opt} N={n}: params {diff:.2e}, loss curve rel {rel:.2e}")
    if opt == "adam":  # Adam divides by sqrt(v): its params amplify rounding
        assert rel <= 1e-4 and diff <= 1e-4
    else:
        assert diff <= 1e-5 and rel <= 1e-5


class _Temperature(nnx.Module):
    """Logits divided by a learned scalar: a param no split divides."""

    def __init__(self, rngs: nnx.Rngs):
        self.mlp = odd_mlp()
        self.temperature = nnx.Param(jnp.ones(()))

    def __call__(self, x):
        return self.mlp(x) / self.temperature[...]


@pytest.mark.parametrize("sharding,n", [("full", 3), ("optimizer", 3), ("full", 1)])
def test_a_scalar_param_is_summed_whole_in_a_split_layout(sharding, n):
    """A scalar param (a temperature) stays whole on every device of a
    split layout; its gradient was scattered along no dimension (a raw
    TypeError before the first step)."""
    def run(n, sharding):
        t = dpax.Trainer(_Temperature(nnx.Rngs(0)), dpax.classification_loss, optax.adam(3e-3),
                         devices=n, sharding=sharding)
        fit_digits(t, BATCH)
        return leaves(t)

    assert max_diff(run(n, sharding), run(1, "replicated")) <= 1e-4  # Adam, as above


@pytest.mark.parametrize("kw", [{"grad_accum": 4}, {"steps_per_call": 4},
                                {"clip_norm": 0.2}], ids=lambda kw: next(iter(kw)))
def test_fsdp_equals_one_device_with_accumulation_multi_step_calls_and_clipping(kw):
    t = trainer(3, "momentum", sharding="full", **kw)
    ref_kw = {"clip_norm": kw["clip_norm"]} if "clip_norm" in kw else {}
    diff, rel = compare(t, "momentum", **ref_kw)
    print(f"full N=3 {kw}: params {diff:.2e}, loss curve rel {rel:.2e}")
    # With 4 steps per call, a log row is the mean of the call's 4 steps.
    assert diff <= 1e-5 and (rel <= 1e-5 or "steps_per_call" in kw)
    if "clip_norm" in kw:  # the clip acted: the global norm is 0.3-0.4
        unclipped = one_device("momentum")[1]
        assert max_diff(leaves(t), unclipped) > 1e-3


def test_fsdp_in_bf16_equals_replicated_in_bf16():
    kw = dict(precision="bf16", allreduce_dtype="bf16")
    full, rep = trainer(4, "sgd", sharding="full", **kw), trainer(4, "sgd", **kw)
    fit_digits(full, BATCH), fit_digits(rep, BATCH)
    diff = max_diff(leaves(full), leaves(rep))
    print(f"bf16 compute and all-reduce, full vs replicated on 4: {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_fsdp_with_syncbatchnorm_and_dropout_equals_one_device():
    ds = dpax.data.random_images(n=256, side=8, classes=4)

    def cnn_bn(n, **kw):
        model = dpax.models.CNNBN(ds.input_shape, ds.n_out, width=8, rngs=nnx.Rngs(0))
        t = dpax.Trainer(model, dpax.classification_loss, optax.sgd(0.05), devices=n, **kw)
        t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=5)
        return t

    full, one = cnn_bn(5, sharding="full"), cnn_bn(1)
    diff = max_diff(leaves(full), leaves(one))
    stats = max_diff(nnx.state(full.model(), nnx.BatchStat),
                     nnx.state(one.model(), nnx.BatchStat))
    print(f"cnn-bn full N=5 vs 1: params {diff:.2e}, batch statistics {stats:.2e}")
    assert diff <= 1e-5 and stats <= 1e-5


def bytes_on_first_device(t, *fields):
    first = t.backend.devices[0]
    return sum(s.data.nbytes for f in fields for x in jax.tree.leaves(getattr(t.state, f))
               for s in x.addressable_shards if s.device == first)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_each_device_holds_1_over_n_of_the_state(n):
    rep, full = trainer(n, "adam"), trainer(n, "adam", sharding="full")
    zero = trainer(n, "adam", sharding="optimizer")
    whole = bytes_on_first_device(rep, "params", "opt_state")
    shapes = [np.shape(x) for x in jax.tree.leaves(rep.state.params)]
    # Each leaf split along one dimension, padded there to a multiple of n:
    # params and both moments, plus Adam's replicated step count.
    padded = sum(math.prod(Split.best(s, n).padded_shape) for s in shapes)
    mine = bytes_on_first_device(full, "params", "opt_state")
    print(f"N={n}: full holds {mine} B/device, replicated/N {whole / n:.0f} B")
    assert mine == 3 * 4 * padded // n + 4
    assert whole / n <= mine <= 1.05 * whole / n
    slack = 3 * 4 * (padded - sum(math.prod(s) for s in shapes)) / n + 4
    opt = bytes_on_first_device(zero, "opt_state")
    assert opt <= bytes_on_first_device(rep, "opt_state") / n + slack
    assert bytes_on_first_device(zero, "params") == bytes_on_first_device(rep, "params")


def test_checkpoints_resume_across_layouts_and_device_counts():
    """A fully sharded state on 8 devices resumes replicated on 2, and a
    replicated one on 2 resumes fully sharded on 5: the state_dict is one
    logical copy without padding."""
    ds = digits()
    ref = trainer(1, "adam")
    ref.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=STEPS + 6)

    first = trainer(8, "adam", sharding="full")
    first.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=STEPS)
    saved = first.state_dict()
    assert {k: np.shape(v) for k, v in saved.items()} == {
        k: np.shape(v) for k, v in ref.state_dict().items()}  # logical shapes
    second = trainer(2, "adam")
    second.load_state_dict(saved)
    second.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=STEPS + 3)
    third = trainer(5, "adam", sharding="full")
    third.load_state_dict(second.state_dict())
    third.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=STEPS + 6)
    diff = max_diff(leaves(third), leaves(ref))
    print(f"full/8 -> replicated/2 -> full/5 vs uninterrupted on 1: {diff:.2e}")
    assert diff <= 1e-5


def test_fsdp_evaluates_and_predicts_like_replicated():
    ds = digits()
    full = dpax.Trainer(odd_mlp(), dpax.classification_loss, optax.sgd(0.1), devices=3,
                        sharding="full", predict_fn=dpax.classification_predict)
    fit_digits(full, BATCH, steps=40)
    rep = trainer(3)
    rep.load_state_dict(full.state_dict())
    a, b = full.evaluate(ds.x_eval, ds.y_eval), rep.evaluate(ds.x_eval, ds.y_eval)
    assert a == pytest.approx(b, rel=1e-6) and a["accuracy"] > 0.3  # learned: chance is 0.1
    np.testing.assert_array_equal(full.predict(ds.x_eval),
                                  np.argmax(rep.model()(ds.x_eval), -1))


def test_every_layout_skips_the_same_steps():
    """A NaN hyperparameter makes the first update NaN: every layout applies
    it (with `skip_nonfinite`, a step is skipped for a non-finite loss or
    gradient, whatever the layout), then skips the steps whose gradients are NaN. `dpax train` fails
    such a run at its end (test_failures.py)."""
    ds = digits()
    runs = {}
    for sharding in ("replicated", "optimizer", "full"):
        t = dpax.Trainer(odd_mlp(), dpax.classification_loss,
                         optax.sgd(0.1, momentum=math.nan), devices=2, max_bad_steps=None,
                         sharding=sharding, skip_nonfinite=True)
        rows = t.fit(ds.x_train, ds.y_train, batch_size=50, until_step=3, log_every=1)
        runs[sharding] = [r["skipped"] for r in rows], leaves(t)
    skipped, params = runs["replicated"]
    assert skipped == [0, 1, 1] and all(np.isnan(p).all() for p in params)
    for sharding in ("optimizer", "full"):
        assert runs[sharding][0] == skipped
        for a, b in zip(runs[sharding][1], params):
            np.testing.assert_array_equal(a, b)


# `make test` passes the class of the layout with the most to get wrong;
# taking a class is the same code for each.
@pytest.mark.parametrize("name", [n if n == "full" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in layout.SHARDINGS])
def test_a_layout_class_trains_what_its_name_trains(name):
    """`sharding` takes a layout class as well as its name (`layout.LAYOUTS`):
    the same layout, the same params to the bit."""
    by_name, by_class = (trainer(3, "adam", sharding=s, grad_accum=2)
                         for s in (name, layout.LAYOUTS[name]))
    fit_digits(by_name, BATCH, steps=3), fit_digits(by_class, BATCH, steps=3)
    assert type(by_class.layout) is layout.LAYOUTS[name] and by_class.layout.name == name
    for a, b in zip(leaves(by_name), leaves(by_class)):
        np.testing.assert_array_equal(a, b)


def test_each_layout_declares_what_the_step_the_estimate_and_the_count_ask():
    """Every built-in layout implements the whole `Layout` protocol itself, and
    its memory and bytes models need no state: asked of the class."""
    declared = [k for k in vars(layout.Layout) if not k.startswith("_")]
    declared += list(layout.Layout.__annotations__)
    state = init_state(odd_mlp(), optax.adam(1e-3), 0)[1]
    params = {"w": jax.ShapeDtypeStruct((5, 3), np.float32)}  # 5 splits over 2 with padding
    for name, cls in layout.LAYOUTS.items():
        made = cls(state, 2)
        for member in declared:
            assert hasattr(made, member), (name, member)
        assert made.name == name
        assert jax.tree.structure(made.grad_splits) == jax.tree.structure(made.splits.params)
        least = cls.least_collectives(60, 60)
        assert cls.step_collectives(params, 1) == {}
        padded = 6 * 3 * 4 if not cls.whole_state else 60
        assert cls.step_collectives(params, 2) == cls.least_collectives(padded, padded)
        assert least == ({"all-reduce": 60} if name == "replicated"
                         else {"reduce-scatter": 60, "all-gather": 60})
        mem = cls.memory(params, params, 2, model_bytes=7)
        assert list(mem) == ["model", "params", "optimizer", "gradients", "update"]
        assert mem["model"] == (7 if cls.whole_state else 0)


@pytest.mark.parametrize("kw,message", [
    ({"sharding": "full", "backend": "pmap"}, "`sharding=full` needs `backend=shard_map`"),
    ({"sharding": layout.FSDP, "backend": "pmap"}, "`sharding=full` needs `backend=shard_map`"),
    ({"sharding": 3}, "`sharding` must be one of replicated, optimizer, full or a layout"),
    ({"sharding": "zero3"}, "`sharding` must be one of replicated, optimizer, full"),
    ({"sharding": int}, "`sharding` must be one of replicated, optimizer, full or a layout"),
    ({"shard_optimizer_state": True}, "Trainer takes no argument shard_optimizer_state")])
def test_sharding_mistakes_are_one_line_errors(kw, message):
    with pytest.raises(DpaxError, match=message):
        trainer(2, **kw)


def test_the_estimate_refuses_an_unknown_layout_in_one_line():
    with pytest.raises(DpaxError, match="`sharding` must be one of"):
        layout.layout_class("zero3")
