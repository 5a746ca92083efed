"""Model state that a step can leave different on each device
(`dpax.analysis.varying`): a layer dpax does not synchronize that computes
state from each device's rows is refused before training, and state that every
device computes alike is left as it is (averaging it over 3 devices rounds)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dpax
from dpax.analysis.varying import analyze
from dpax.collectives import exact_sums
from dpax.errors import PerDeviceRandom, PerDeviceState
from dpax.parallel.mesh import AXIS

ROWS = 60  # 20 rows a device on 3 devices, 15 on 4: no padding


def test_varies_follows_the_rows_through_calls_branches_loops_and_collectives():
    def fn(params, batch):
        m = batch.mean(0)
        steps = jax.lax.scan(lambda c, r: (c + r, None), params, batch)[0]
        return {
            "params": params * 2,
            "rows": m,
            "psum": jax.lax.psum(m, AXIS),
            "gathered": jax.lax.all_gather(m, AXIS),
            "exact": exact_sums((batch,), AXIS),  # custom_vjp around psums of per-device slots
            "index": params + jax.lax.axis_index(AXIS),
            "jit": jax.jit(lambda a, b: (a + 1, b + 1))(params, m),
            "remat": jax.checkpoint(lambda a, b: (a * 2, b * 2))(params, m),
            "cond on rows": jax.lax.cond(m.sum() > 0, lambda p: p, lambda p: -p, params),
            "cond on params": jax.lax.cond(params.sum() > 0, lambda p: p, lambda p: -p, params),
            "branch of rows": jax.lax.cond(params.sum() > 0, lambda: params, lambda: m),
            "scan over rows": steps,
        }

    result = {}

    def per_device(params, batch):  # as in a step: traced inside shard_map
        flags, _ = analyze(fn, (params, batch), (False, True), AXIS, 4)
        paths = jax.tree_util.tree_flatten_with_path(jax.eval_shape(fn, params, batch))[0]
        result.update({jax.tree_util.keystr(p): f for (p, _), f in zip(paths, flags)})
        return params

    mesh = Mesh(np.array(jax.devices()[:4]), (AXIS,))
    jax.eval_shape(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                                 check_vma=False),
                   jnp.ones(3), jnp.ones((20, 3)))
    want_varying = {"rows", "index", "jit'][1", "remat'][1", "cond on rows", "branch of rows",
                    "scan over rows"}
    assert len(result) == 15
    for key, v in result.items():
        assert v == any(f"['{w}" in key for w in want_varying), key


class RunningMean(nnx.Module):
    """A user's own normalizer: a running mean of the rows it sees."""

    def __init__(self, d):
        self.mean = nnx.BatchStat(jnp.zeros(d))

    def __call__(self, x):
        self.mean[...] = 0.9 * self.mean[...] + 0.1 * x.mean(0)
        return x - self.mean[...]


class Centered(nnx.Module):
    def __init__(self, rngs):
        self.norm = RunningMean(8)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(x))


class Buffers(nnx.Module):
    """Float state every device computes alike: a constant buffer, and an
    average of the params (not of the rows)."""

    def __init__(self, rngs):
        self.scale = nnx.Variable(jax.random.uniform(jax.random.key(1), (8,), minval=0.5))
        self.out = nnx.Linear(8, 3, rngs=rngs)
        self.kernel_avg = nnx.BatchStat(jnp.zeros((8, 3)))

    def __call__(self, x):
        # Products by 0.5 are exact: 1 and 3 devices' programs round alike.
        self.kernel_avg[...] = 0.5 * self.kernel_avg[...] + 0.5 * self.out.kernel[...]
        return self.out(x * self.scale[...])


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.7)(x)
        return nn.Dense(3)(nn.relu(x))


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 8)).astype(np.float32) * np.linspace(0.5, 3, ROWS)[:, None]
    return x, rng.integers(0, 3, ROWS)


@pytest.mark.parametrize("options", [{}, {"backend": "pmap"}, {"sharding": "full"},
                                     {"grad_accum": 3}])
def test_state_from_each_devices_rows_is_refused_before_training(options):
    x, y = data()
    model = Centered(nnx.Rngs(0))
    t = dpax.Trainer(model, dpax.classification_loss, optax.sgd(0.1), devices=4, **options)
    with pytest.raises(PerDeviceState, match="sync_batchnorm=False") as e:
        t.fit(x, y, batch_size=ROWS, epochs=1)
    assert e.value.paths == ["norm.mean.value"] and len(str(e.value).splitlines()) == 1
    assert t.step == 0 and np.array_equal(model.norm.mean[...], np.zeros(8))


class Positives(nnx.Module):
    """Counts the positive first features it has seen: an integer per device."""

    def __init__(self, rngs):
        self.seen = nnx.Variable(jnp.zeros((), jnp.int32))
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        self.seen[...] += (x[:, 0] > 0).sum().astype(jnp.int32)
        return self.out(x)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_a_count_from_each_devices_rows_is_refused_even_when_averaging(backend):
    """Before, shard_map failed on its out_specs and pmap kept replica 0's count."""
    x, y = data()
    one = Positives(nnx.Rngs(0))
    dpax.Trainer(one, dpax.classification_loss, optax.sgd(0.1), devices=1).fit(
        x, y, batch_size=ROWS, until_step=2)
    assert int(one.seen[...]) == 2 * int((x[:, 0] > 0).sum())
    t = dpax.Trainer(Positives(nnx.Rngs(0)), dpax.classification_loss, optax.sgd(0.1),
                     devices=4, backend=backend, sync_batchnorm=False)
    with pytest.raises(PerDeviceState, match="seen.value") as e:
        t.fit(x, y, batch_size=ROWS, until_step=2)
    assert "sync_batchnorm" not in str(e.value)


def test_such_state_trains_on_one_device_and_averaged_when_asked():
    x, y = data()
    one = Centered(nnx.Rngs(0))
    dpax.Trainer(one, dpax.classification_loss, optax.sgd(0.1), devices=1).fit(
        x, y, batch_size=ROWS, until_step=1)
    np.testing.assert_allclose(one.norm.mean[...], 0.1 * x.mean(0), rtol=1e-6)
    t = dpax.Trainer(Centered(nnx.Rngs(0)), dpax.classification_loss, optax.sgd(0.1),
                     devices=4, sync_batchnorm=False)
    t.fit(x, y, batch_size=ROWS, until_step=1)
    mean = t.model().norm.mean[...]  # the average of 4 devices' running means
    np.testing.assert_allclose(mean, 0.1 * x.reshape(4, -1, 8).mean(1).mean(0), atol=1e-7)
    assert dpax.pmap.replicas_in_sync(t.state)


@pytest.mark.equivalence
@pytest.mark.parametrize("make", [
    lambda: Buffers(nnx.Rngs(0)),
    lambda: dpax.from_linen(LinenBN(), np.zeros((1, 8), np.float32), seed=0),
], ids=["buffers", "linen-batchnorm"])
def test_state_every_device_computes_alike_keeps_one_devices_bits_on_3(make):
    """With params held still (lr 0), one device's model state after 8 steps,
    bit for bit, on 3 devices: it is not averaged (a sum of 3 equal floats
    divided by 3 changes the last bit of about one in seven)."""
    x, y = data()
    states = []
    for n in (1, 3):
        t = dpax.Trainer(make(), dpax.classification_loss, optax.sgd(0.0), devices=n)
        t.fit(x, y, batch_size=ROWS, until_step=8)
        states.append({k: np.asarray(v) for k, v in t.state_dict().items()
                       if k.startswith("model_state")})
    assert states[0].keys() == states[1].keys() and states[0]
    for k in states[0]:
        assert np.array_equal(states[0][k], states[1][k]), k


class DropPath(nnx.Module):
    """Stochastic depth as often written: a mask per row from the layer's own
    key, which is the same on every device."""

    def __init__(self, rate, per_example=False):
        self.rate, self.per_example = rate, per_example
        self.rngs = nnx.Rngs(droppath=1)

    def __call__(self, x):
        if self.per_example:  # dpax's: each example's mask from its own index
            return dpax.models.layers.example_dropout(x, self.rate, broadcast_dims=(1,))
        keep = jax.random.bernoulli(self.rngs.droppath(), 1 - self.rate, (x.shape[0], 1))
        return jnp.where(keep, x / (1 - self.rate), 0.0)


class Residual(nnx.Module):
    def __init__(self, rngs, per_example=False, noise=False):
        self.hidden = nnx.Linear(8, 8, rngs=rngs)
        self.drop = DropPath(0.5, per_example)
        self.out = nnx.Linear(8, 3, rngs=rngs)
        self.noise = nnx.Rngs(noise=2) if noise else None

    def __call__(self, x):
        if self.noise is not None:  # one draw for every row: the same on 1 or N devices
            x = x + 0.1 * jax.random.normal(self.noise.noise(), (8,))
        return self.out(x + self.drop(nnx.relu(self.hidden(x))))


def train_residual(n, **kw):
    x, y = data()
    t = dpax.Trainer(Residual(nnx.Rngs(0), **kw), dpax.classification_loss, optax.sgd(0.1),
                     devices=n)
    t.fit(x, y, batch_size=ROWS, until_step=4)
    return t


def test_a_mask_per_row_from_the_models_own_key_is_refused_before_training():
    with pytest.raises(PerDeviceRandom, match=r"shaped \(15, 1\).*example_dropout"):
        train_residual(4)
    train_residual(1)  # one device draws what it draws


class NoisePerRow(nnx.Module):
    """Noise per example from the model's own key, the usual ways: a key per
    row, split from it or folded in with the row's position, under vmap."""

    def __init__(self, how, rngs):
        self.how, self.noise = how, nnx.Rngs(noise=1)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        key = self.noise.noise()
        if self.how == "split":
            keys = jax.random.split(key, x.shape[0])
        else:
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(x.shape[0]))
        return self.out(x + 0.1 * jax.vmap(lambda k: jax.random.normal(k, (8,)))(keys))


@pytest.mark.parametrize("how", ["split", "fold_in"])
def test_a_key_per_row_from_the_models_own_key_is_refused_before_training(how):
    """Each device splits (or folds) the same key for its own rows, so its
    row i gets one device's row i's noise: refused like a draw shaped by
    the rows (these trained 9e-3 away from one device on 3)."""
    x, y = data()
    t = dpax.Trainer(NoisePerRow(how, nnx.Rngs(0)), dpax.classification_loss,
                     optax.sgd(0.1), devices=4)
    with pytest.raises(PerDeviceRandom, match=r"shaped \(\d+, 8\)"):
        t.fit(x, y, batch_size=ROWS, until_step=1)
    one = dpax.Trainer(NoisePerRow(how, nnx.Rngs(0)), dpax.classification_loss,
                       optax.sgd(0.1), devices=1)
    one.fit(x, y, batch_size=ROWS, until_step=1)  # one device draws what it draws


@pytest.mark.parametrize("seed", [0, 1])
def test_per_example_masks_and_draws_shared_by_every_row_train_as_on_one_device(seed):
    """Not refused: masks from each example's index (dpax's), and a draw whose
    shape does not follow the rows; 4 devices then train one device's params."""
    def params(n):
        x, y = data(seed)
        t = dpax.Trainer(Residual(nnx.Rngs(seed), per_example=True, noise=True),
                         dpax.classification_loss, optax.sgd(0.1), devices=n, seed=seed)
        t.fit(x, y, batch_size=ROWS, until_step=4)
        return jax.tree.leaves(t.params)

    one, four = params(1), params(4)
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, four)) <= 1e-6
