"""A model that sows intermediates (`Module.sow`) trains as the same model
without the sow: what a call sows is an output of that call, not state a
step carries (`dpax.training.state.SOWN`). A loss may read what the
forward sowed; a forward that makes Variables of its own is refused."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import max_diff
from dpax.errors import DpaxError


class Net(nnx.Module):
    def __init__(self, rngs, sow=True):
        self.a = nnx.Linear(8, 16, rngs=rngs)
        self.b = nnx.Linear(16, 3, rngs=rngs)
        self.sows = sow

    def __call__(self, x):
        h = nnx.relu(self.a(x))
        if self.sows:
            with warnings.catch_warnings():  # sow outside nnx.capture: deprecated, still common
                warnings.simplefilter("ignore", DeprecationWarning)
                self.sow(nnx.Intermediate, "hidden", h)
        return self.b(h)


def ce(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def with_sown_penalty(model, batch):
    """An auxiliary loss on what the forward sowed, popped from the model."""
    losses = ce(model, batch)
    (h,) = jax.tree.leaves(nnx.pop(model, nnx.Intermediate))
    return losses + 0.01 * (h ** 2).sum(-1)


def with_penalty(model, batch):
    """The same loss, computed without a sow."""
    h = nnx.relu(model.a(batch["x"]))
    return optax.softmax_cross_entropy_with_integer_labels(model.b(h), batch["y"]) \
        + 0.01 * (h ** 2).sum(-1)


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(30, 8)).astype(np.float32), rng.integers(0, 3, 30).astype(np.int32)


def trained(n, seed, sow=True, loss=ce, called=False):
    x, y = data(seed)
    model = Net(nnx.Rngs(seed), sow)
    if called:  # a call before the Trainer: the model holds what it sowed
        model(x[:5])
    t = dpax.Trainer(model, loss, optax.adam(0.05), devices=n)
    t.fit(x, y, batch_size=15, until_step=3, log_every=10**9)
    return t, model


@pytest.mark.parametrize("seed", [0, 1])
def test_a_sowing_model_trains_as_the_same_model_without_the_sow(seed):
    """It crashed at the first step (the forward's state gained a Variable)."""
    reference = trained(1, seed, sow=False)[0].params
    for n in (1, 2, 4):
        diff = max_diff(reference, trained(n, seed)[0].params)
        assert diff < 1e-6, (n, diff)


def test_a_model_that_sowed_before_the_trainer_trains_and_keeps_what_it_sowed():
    """It crashed in Trainer() (a tuple where a Variable's array was). The
    user's model gets the trained params and keeps its own intermediates."""
    reference = trained(1, 0, sow=False)[0].params
    t, model = trained(2, 0, called=True)
    assert max_diff(reference, t.params) < 1e-6
    assert max_diff(t.params, nnx.state(model, nnx.Param)) == 0.0
    (kept,) = jax.tree.leaves(nnx.state(model, nnx.Intermediate))
    assert kept.shape == (5, 16)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_loss_reads_what_the_forward_sowed(seed):
    reference = trained(1, seed, sow=False, loss=with_penalty)[0].params
    for n in (1, 2):
        diff = max_diff(reference, trained(n, seed, loss=with_sown_penalty)[0].params)
        assert diff < 1e-6, (n, diff)


class Lazy(nnx.Module):
    """Makes a Variable in its first forward."""

    def __init__(self, rngs):
        self.l = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        if not hasattr(self, "calls"):
            self.calls = nnx.BatchStat(jnp.zeros(()))
        return self.l(x)


def test_a_forward_that_makes_a_variable_is_refused_in_one_line():
    x, y = data(0)
    t = dpax.Trainer(Lazy(nnx.Rngs(0)), ce, optax.adam(0.05), devices=2)
    before = t.params
    with pytest.raises(DpaxError, match=r"\(made: calls\).*create every Variable in __init__"):
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert int(t.state.step) == 0
    assert max_diff(before, t.params) == 0.0
