"""What the forward's outputs do not need is not judged by the refusals
(`dpax.analysis.live`): a `jax.debug.print` of the batch's mean loss, or a
value computed and left unused, changes nothing N devices train. What the
outputs need is judged as before, prints or not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import io_callback

import dpax
from conftest import max_diff
from dpax.analysis.live import live
from dpax.errors import MixesExamples, ReadsBatchSize


class Net(nnx.Module):
    """A linear layer, then a scan over its outputs' features that prints
    each round's batch sum: a print inside a sub-jaxpr."""

    def __init__(self, rngs):
        self.l = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = self.l(x)
        jax.debug.print("features' batch sums {}", h.sum(0))

        def round_(carry, col):
            jax.debug.print("a column's batch mean {}", col.mean())
            return carry, jnp.tanh(col)

        _, cols = jax.lax.scan(round_, 0.0, h.T)
        return cols.T


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def printing(model, batch):
    losses = ce(model(batch["x"]), batch["y"])
    jax.debug.print("the batch's mean loss {}", losses.mean())
    unused = losses.sum() / losses.shape[0]  # noqa: F841 - computed, never returned
    return losses


def printing_and_scaled(model, batch):
    return printing(model, batch) / batch["x"].shape[0]


def printing_and_rolled(model, batch):
    losses = printing(model, batch)
    return losses * jnp.roll(losses, 1)


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(30, 8)).astype(np.float32), rng.integers(0, 3, 30).astype(np.int32)


def params_after(n, seed, loss=printing):
    x, y = data(seed)
    t = dpax.Trainer(Net(nnx.Rngs(seed)), loss, optax.adam(0.05), devices=n)
    t.fit(x, y, batch_size=15, until_step=2, log_every=10**9)
    return t.params


@pytest.mark.parametrize("seed", [0, 1])
def test_a_loss_and_model_that_print_batch_statistics_train_as_one_device(seed, capfd):
    """Refused before `live` (ReadsBatchSize at the mean the loss prints)."""
    one = params_after(1, seed)
    for n in (2, 4):
        diff = max_diff(one, params_after(n, seed))
        assert diff < 1e-6, (n, diff)
    assert "the batch's mean loss" in capfd.readouterr().out


@pytest.mark.parametrize("loss,error", [(printing_and_scaled, ReadsBatchSize),
                                        (printing_and_rolled, MixesExamples)])
def test_what_the_loss_returns_is_judged_beside_the_prints(loss, error):
    x, y = data(0)
    t = dpax.Trainer(Net(nnx.Rngs(0)), loss, optax.adam(0.05), devices=2)
    with pytest.raises(error, match="test_live.py"):
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert int(t.state.step) == 0


def _count(jaxpr, name) -> int:
    """Equations named `name` in `jaxpr` and its sub-jaxprs."""
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive.name == name
        for p in eqn.params.values():
            for body in p if isinstance(p, tuple) else (p,):
                if isinstance(body, jax.extend.core.ClosedJaxpr):
                    found += _count(body.jaxpr, name)
                elif isinstance(body, jax.extend.core.Jaxpr):
                    found += _count(body, name)
    return found


def test_live_drops_prints_and_what_only_they_read_and_keeps_other_effects():
    def fn(x):
        jax.debug.print("{}", x.mean())
        jax.debug.callback(lambda v: None, x.min())
        _, ys = jax.lax.scan(lambda c, r: (jax.debug.print("{}", r.sum()) or c, r * 2), 0.0, x)
        io_callback(lambda v: None, None, x.max(), ordered=True)  # a host effect: kept
        unused = jnp.exp(x)  # noqa: F841
        return ys + 1

    closed = jax.make_jaxpr(fn)(jnp.ones((4, 3)))
    kept = live(closed)
    assert _count(closed.jaxpr, "debug_print") == 2
    assert _count(kept.jaxpr, "debug_print") == 0
    names = [e.primitive.name for e in kept.jaxpr.eqns]
    assert _count(kept.jaxpr, "debug_callback") == 0
    assert "exp" not in names and "reduce_min" not in names
    assert "io_callback" in names and "reduce_max" in names
    assert kept.jaxpr.invars == closed.jaxpr.invars and kept.jaxpr.outvars == closed.jaxpr.outvars
    # What is left computes what the whole did.
    x = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(jax.core.eval_jaxpr(kept.jaxpr, kept.consts, x)[0], fn(x))
