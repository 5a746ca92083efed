"""Models that are not NNX modules (`dpax.models.bridge`): a Flax Linen CNN with
BatchNorm and Dropout, and a plain function of a params pytree, train on N
devices as on one; `dpax check` passes them and names the cause when broken."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import dpax
from conftest import digits, max_diff
from dpax.errors import DpaxError

BATCH = 37  # uneven for 4 and 8 devices: the last device holds padding


class LinenCNN(nn.Module):
    """A conv without biases before BatchNorm (its mean removes them: their
    exact gradient is 0, and Adam would step on the rounding noise). One
    such block: a second would prove nothing more, and compile for long."""

    rate: float = 0.3

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        x = nn.Dropout(self.rate, deterministic=not train)(x.reshape(x.shape[0], -1))
        return nn.Dense(10)(x)


def linen_cnn(seed=0, rate=0.3):
    return dpax.from_linen(LinenCNN(rate), digits().x_train[:1], seed=seed)


def mlp_apply(params, x, rate=0.2):
    h = x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"]
    h = dpax.models.layers.example_dropout(jax.nn.relu(h), rate)
    return h @ params["w2"] + params["b2"]


def mlp_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": 0.1 * jax.random.normal(k1, (64, 32)), "b1": jnp.zeros(32),
            "w2": 0.1 * jax.random.normal(k2, (32, 10)), "b2": jnp.zeros(10)}


def function_mlp(seed=0, rate=0.2):
    return dpax.from_function(functools.partial(mlp_apply, rate=rate), mlp_params(seed))


MODELS = {"linen-cnn": linen_cnn, "function-mlp": function_mlp}


def flat(x):
    return x.reshape(x.shape[0], -1)


def equinox_mlp(seed=0):
    """An Equinox MLP as `eqx.partition` splits it; returns (apply, params)."""
    eqx = pytest.importorskip("equinox")
    params, static = eqx.partition(eqx.nn.MLP(64, 10, 32, 1, key=jax.random.key(seed)),
                                   eqx.is_array)
    return lambda p, x: jax.vmap(eqx.combine(p, static))(flat(x)), params


def haiku_mlp(seed=0):
    """A Haiku MLP's apply (no rng: it draws none) and params."""
    hk = pytest.importorskip("haiku")
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 10])(flat(x))))
    return net.apply, net.init(jax.random.key(seed), digits().x_train[:1])


PYTREES = {"dict": lambda: (mlp_apply, mlp_params()), "equinox": equinox_mlp,
           "haiku": haiku_mlp}


def train(make, n, seed, steps=12):
    ds = digits()
    model = make(seed)
    t = dpax.Trainer(model, dpax.classification_loss, optax.adam(3e-3), devices=n, seed=seed)
    rows = t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=steps, seed=seed,
                 log_every=steps)
    return t, model, rows


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_other_models_train_on_n_devices_as_on_one(name, seed):
    one, _, _ = train(MODELS[name], 1, seed)
    start = jax.tree.leaves(nnx.state(MODELS[name](seed), nnx.Param))
    assert max_diff(jax.tree.leaves(one.params), start) > 1e-3  # it trained
    # 4 and 8 both leave the last device padding with 37 rows: each seed takes one.
    for n in (4,) if seed == 0 else (8,):
        t, _, _ = train(MODELS[name], n, seed)
        diff = max_diff(jax.tree.leaves(t.params), jax.tree.leaves(one.params))
        state = max_diff(nnx.state(t.model(), nnx.BatchStat),
                         nnx.state(one.model(), nnx.BatchStat))
        print(f"{name} seed {seed}, 1 vs {n}: params {diff:.1e}, model state {state:.1e}")
        assert diff <= 1e-5 and state <= 1e-5


@pytest.mark.parametrize("kind", [k if k == "dict" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in sorted(PYTREES)])
def test_a_function_model_hands_its_params_back_in_their_own_type(kind):
    """`model.pytree()` is the pytree given to `from_function`, its type and
    structure, holding the trained arrays after `fit` (in the user's model,
    and in `Trainer.model()`, the EMA too); 4 devices give 1's params."""
    ds = digits()
    trained = {}
    for n in (1, 4):
        apply, params = PYTREES[kind]()
        model = dpax.from_function(apply, params)
        t = dpax.Trainer(model, dpax.classification_loss, optax.adam(3e-3), devices=n,
                         ema_decay=0.5)
        t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=6)
        got, ema = model.pytree(), t.model(ema=True).pytree()
        for tree in (got, ema):
            assert type(tree) is type(params)
            assert jax.tree.structure(tree) == jax.tree.structure(params)
        assert max_diff(got, t.model(ema=False).pytree()) == 0.0  # the trained params
        assert max_diff(got, params) > 1e-3 and max_diff(ema, got) > 1e-6
        assert model(ds.x_eval[:3]).shape == (3, 10)
        trained[n] = got
    diff = max_diff(trained[4], trained[1])
    print(f"{kind}: 4 vs 1 device, params {diff:.1e}")
    assert diff <= 1e-5


def test_linen_batchnorm_uses_the_global_batch_and_dropout_masks_examples():
    """What the Linen layers compute in a dpax step, against a hand-written
    global computation: the running mean after one step is the mean over the
    real examples only, whatever the padding."""
    ds = digits()
    x = ds.x_train[:BATCH]
    t = dpax.Trainer(linen_cnn(), dpax.classification_loss, optax.sgd(0.0), devices=8)
    t.fit(x, ds.y_train[:BATCH], batch_size=BATCH, until_step=1)
    variables = {"params": _linen(t.params), "batch_stats": {}}
    features = nn.Conv(8, (3, 3), use_bias=False).apply(
        {"params": variables["params"]["Conv_0"]}, x)
    want = 0.1 * features.mean((0, 1, 2))  # momentum 0.9 from zeros
    got = _linen(nnx.state(t.model(), nnx.BatchStat))["BatchNorm_0"]["mean"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_the_dropout_layers_drop():
    """Against the same models without dropout: the masks are applied (the
    equivalence above would also hold if dropout were silently off)."""
    for make in (linen_cnn, function_mlp):  # on 4 devices: the steps compiled above
        with_dropout = train(make, 4, 0, steps=4)[0].params
        without = train(functools.partial(make, rate=0.0), 4, 0, steps=4)[0].params
        assert max_diff(with_dropout, without) > 1e-4


def _linen(state):
    """The Linen variables of a LinenModel's state, as a plain dict."""
    return nnx.to_pure_dict(state)["wrapped"]


def test_eval_mode_passes_train_false_and_uses_the_running_averages():
    ds = digits()
    t, model, _ = train(linen_cnn, 4, 0)
    model.eval()
    x = ds.x_eval[:50]
    variables = {"params": _linen(nnx.state(model, nnx.Param)),
                 "batch_stats": _linen(nnx.state(model, nnx.BatchStat))}
    np.testing.assert_allclose(np.asarray(model(x)),
                               np.asarray(LinenCNN().apply(variables, x, train=False)),
                               rtol=1e-5, atol=1e-6)
    assert t.evaluate(ds.x_eval, ds.y_eval)["accuracy"] > 0.3


class BatchNormMLP(nnx.Module):
    """A user's NNX model with the layers dpax replaces inside its step:
    BatchNorm (synced over the devices) and Dropout (masks per example)."""

    def __init__(self, in_shape, n_out, rngs):
        self.hidden = nnx.Linear(int(np.prod(in_shape)), 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(16, n_out, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.bn(self.hidden(flat(x))))))


@pytest.mark.parametrize("backend", ["shard_map", pytest.param("pmap", marks=pytest.mark.slow)])
def test_the_users_model_holds_the_trained_state_and_keeps_its_classes(backend):
    """`fit` leaves the trained params and state in the model given (NNX's
    in-place convention) and does not convert its layers' classes."""
    ds = digits()
    model = BatchNormMLP(ds.input_shape, ds.n_out, nnx.Rngs(0))
    t = dpax.Trainer(model, dpax.classification_loss, optax.adam(1e-3), devices=4,
                     backend=backend)
    t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=3)
    assert max_diff(nnx.state(model, nnx.Param), t.params) == 0.0
    assert max_diff(nnx.state(model, nnx.BatchStat), nnx.state(t.model(), nnx.BatchStat)) == 0.0
    kinds = {type(m) for _, m in nnx.iter_modules(model)}
    assert nnx.BatchNorm in kinds and nnx.Dropout in kinds
    assert not kinds & {dpax.models.layers.SyncBatchNorm, dpax.models.layers.ExampleDropout}
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert isinstance(leaf, jax.Array)
    # The model's arrays are its own copies: the next call's steps donate the
    # Trainer's buffers, and the model keeps the state of the last call.
    t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=5)
    assert max_diff(nnx.state(model, nnx.Param), t.params) == 0.0
    assert max_diff(nnx.state(model, nnx.BatchStat), nnx.state(t.model(), nnx.BatchStat)) == 0.0


@pytest.mark.slow
def test_check_passes_linen_and_function_models_and_names_the_cause_of_a_broken_one():
    ds = digits()
    for make in (linen_cnn, function_mlp):
        result = dpax.check_equivalence(make, dpax.classification_loss, ds.x_train,
                                        ds.y_train, devices=4)
        print(result.report())
        assert result.equivalent
    unsynced = dpax.check_equivalence(linen_cnn, dpax.classification_loss, ds.x_train,
                                      ds.y_train, devices=4, sync_batchnorm=False)
    assert unsynced.cause == "batchnorm-off" and "BatchNorm_0" in unsynced.report()

    def batch_normalized(params, x):  # mixes examples: a mean over the batch axis
        x = x - x.mean(0, keepdims=True)
        return mlp_apply(params, x)

    mixes = dpax.check_equivalence(lambda: dpax.from_function(batch_normalized, mlp_params()),
                                   dpax.classification_loss, ds.x_train, ds.y_train, devices=4)
    assert mixes.cause == "model-mixes"


def test_bad_bridge_input_is_one_line():
    with pytest.raises(DpaxError, match="takes no `train`"):
        dpax.from_linen(nn.Dense(3), np.ones((1, 4)))
    with pytest.raises(DpaxError, match="flax.linen Module"):
        dpax.from_linen(dpax.models.Linear((4,), 3, rngs=nnx.Rngs(0)), np.ones((1, 4)))
    with pytest.raises(DpaxError, match="needs params"):
        dpax.from_function(mlp_apply, {})
    with pytest.raises(DpaxError, match=r"params hold a function at params\['act'\]; give a "
                       "pytree of arrays only"):  # e.g. an Equinox module not partitioned
        dpax.from_function(mlp_apply, {"w": np.ones(3), "act": lambda x: x})
    model = dpax.from_linen(nn.Dense(3), np.ones((1, 4)), train_kwarg=None)
    assert model(np.ones((2, 4))).shape == (2, 3)


@pytest.mark.slow
def test_dpax_check_takes_a_factory_of_a_linen_module(tmp_path, capsys, monkeypatch):
    (tmp_path / "linenmodels.py").write_text(
        "from flax import linen as nn\n\n\n"
        "class Net(nn.Module):\n"
        "    n_out: int\n\n"
        "    @nn.compact\n"
        "    def __call__(self, x, train: bool = False):\n"
        "        x = nn.Dense(16, use_bias=False)(x.reshape(x.shape[0], -1))\n"
        "        x = nn.BatchNorm(use_running_average=not train)(x)\n"
        "        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))\n"
        "        return nn.Dense(self.n_out)(x)\n\n\n"
        "def make(input_shape, n_out, rngs):\n"
        "    return Net(n_out)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from dpax.cli import main

    assert main(["check", "--factory", "linenmodels:make", "--devices", "4"]) == 0
    assert "equivalent" in capsys.readouterr().out
    assert main(["check", "--factory", "linenmodels:make", "--devices", "4",
                 "--no-sync-batchnorm"]) == 1
    assert "BatchNorm_0" in capsys.readouterr().out
