"""The XLA:CPU tuning's per-step compile options: timed on the step that
holds a windowed op, the faster taken, and they change no number (the
reference is the same Trainer with the tuning off: XLA's defaults)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from dpax import data, models
from dpax.models import losses
from dpax.xla_cpu import compile_options


def test_a_step_that_pools_has_the_old_emitters_timed():
    x = jnp.ones((4, 8, 8, 3))

    def pooled_grad(x):  # the pooling sits inside a scan, as in --steps-per-call
        def body(c, xi):
            return c + jax.grad(lambda v: nnx.max_pool(v, (2, 2), (2, 2)).sum())(xi).sum(), None
        return jax.lax.scan(body, 0.0, x[None])[0]

    pooled = jax.make_jaxpr(pooled_grad)(x)
    assert "select_and_scatter_add" in compile_options.primitives(pooled)
    assert compile_options.for_step(pooled) == compile_options.OLD_FUSION_EMITTERS
    dense = jax.make_jaxpr(jax.grad(lambda w: jnp.tanh(x.reshape(4, -1) @ w).sum()))(
        jnp.ones((192, 2)))
    assert compile_options.for_step(dense) == {}


def _trainer(model, **kw):
    return dpax.Trainer(model, losses.classification_loss, optax.sgd(0.1), devices=8, **kw)


class OverlapPoolCNN(nnx.Module):
    """3x3 windows at stride 2 overlap: the gradient stays a select-and-scatter
    (`dpax.xla_cpu.backward` rewrites only pools whose windows do not overlap)."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.dense = nnx.Linear(8 * 3 * 3, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv(x)), (3, 3), strides=(2, 2))
        return self.dense(x.reshape(x.shape[0], -1))


def test_the_chosen_options_change_no_number():
    ds = data.digits()
    chosen = _trainer(OverlapPoolCNN(nnx.Rngs(0)), xla_cpu_tuning=True)
    default = _trainer(OverlapPoolCNN(nnx.Rngs(0)), xla_cpu_tuning=False)
    rows = {}
    for name, t in (("chosen", chosen), ("default", default)):
        rows[name] = t.fit(ds.x_train, ds.y_train, batch_size=61, until_step=3, log_every=1)
        rows[name].append(t.evaluate(ds.x_eval, ds.y_eval, batch_size=100))
    for step in (chosen._steps.train, chosen._steps.eval):
        # Both timed; the candidate runs only where it was clearly the faster.
        assert set(step.timed) == {"default", "candidate"}
        assert step.options == (compile_options.OLD_FUSION_EMITTERS
                                if compile_options.clearly_faster(step.timed) else {})
    assert not isinstance(default._steps.train, compile_options.ChosenJit)  # a plain jit
    assert chosen.traces["train"] == 1  # the choosing trace is the only one
    for a, b in zip(jax.tree.leaves(chosen.params), jax.tree.leaves(default.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    for a, b in zip(rows["chosen"], rows["default"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_a_training_step_whose_pools_are_rewritten_keeps_xla_defaults():
    """2x2 pools at stride 2 (the built-in CNN): the training step holds no
    windowed op after `dpax.xla_cpu.backward`; evaluation still pools."""
    ds = data.digits()
    t = _trainer(models.CNN(ds.input_shape, ds.n_out, rngs=nnx.Rngs(0)))
    t.fit(ds.x_train, ds.y_train, batch_size=64, until_step=1)
    t.evaluate(ds.x_eval[:100], ds.y_eval[:100])
    assert t._steps.train.options == {} and not t._steps.train.timed
    assert set(t._steps.eval.timed) == {"default", "candidate"}


def test_a_model_without_pooling_keeps_xla_defaults():
    t = _trainer(models.MLP((16,), 10, hidden=8, rngs=nnx.Rngs(0)))
    x = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
    t.fit(x, np.zeros(32, np.int32), batch_size=16, until_step=1)
    assert t._steps.train.options == {}


@pytest.mark.parametrize("default_s,candidate_s,chosen", [
    (1.0, 2.0, "default"), (2.0, 1.0, "candidate"),
    (1.0, 0.95, "default"),  # within the margin: a tie, and XLA's defaults stand
])
def test_the_clearly_faster_options_win_whatever_the_op(default_s, candidate_s, chosen,
                                                        monkeypatch):
    """Average pooling, whose old emitters are no faster: the choice follows
    the clock, not the op's name."""
    calls, real = [], compile_options.fastest

    def timed(compiled, args, *rest):
        if set(compiled) != {"default", "candidate"}:  # `dpax.xla_cpu.dots` times its own
            return real(compiled, args, *rest)
        calls.append(sorted(compiled))
        return {"default": default_s, "candidate": candidate_s}

    monkeypatch.setattr(compile_options, "fastest", timed)
    class AvgPoolCNN(OverlapPoolCNN):
        def __call__(self, x):
            x = nnx.avg_pool(nnx.relu(self.conv(x)), (3, 3), strides=(2, 2))
            return self.dense(x.reshape(x.shape[0], -1))

    ds = data.digits()
    t = _trainer(AvgPoolCNN(nnx.Rngs(0)))
    t.fit(ds.x_train, ds.y_train, batch_size=64, until_step=1)
    assert calls == [["candidate", "default"]]  # timed together, once
    assert t._steps.train.options == ({} if chosen == "default" else
                                      compile_options.OLD_FUSION_EMITTERS)


def test_the_timed_steps_take_turns_on_fresh_copies():
    """Each step runs `WARMUP_ROUNDS` times untimed and `calls` times timed,
    the order alternating from round to round; each call gets its own copy of
    the arguments (a step donates them)."""
    order, seen = [], []
    x = jnp.arange(4.0)

    def step(name):
        def run(a):
            order.append(name)
            seen.append(a)
            return a + 1
        return run

    best = compile_options.fastest({"a": step("a"), "b": step("b")}, (x,), calls=3)
    assert compile_options.WARMUP_ROUNDS == 2
    assert order == ["b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert set(best) == {"a", "b"} and all(0 < v < 1 for v in best.values())
    assert all(a is not x for a in seen) and len({id(a) for a in seen}) == len(seen)
    np.testing.assert_array_equal(x, jnp.arange(4.0))
