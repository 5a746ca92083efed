"""Models with batch statistics and randomness keep the promise: synchronized
masked BatchNorm, dropout masks independent of N, and `dpax check`."""

import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import digits, max_diff
from dpax import models
from dpax.cli import main
from dpax.models import losses


# 43 rows: `dpax check`'s uneven batch on 8 devices (5N + 3), so these runs and the
# README's `dpax check --model cnn-bn` commands compile the same steps once.
def train_cnn_bn(n, sync=True, steps=10, batch_size=43):
    ds = digits()
    model = models.make_model("cnn-bn", ds.input_shape, ds.n_out, seed=0)
    t = dpax.Trainer(model, losses.classification_loss, optax.sgd(0.05), devices=n,
                     sync_batchnorm=sync)
    t.fit(ds.x_train, ds.y_train, batch_size=batch_size, until_step=steps)
    host = t.backend.host(t.state)
    return jax.tree.leaves(host.params), [np.asarray(v) for v in jax.tree.leaves(host.model_state)
                                          if not dpax.parallel.arrays.is_key(v)], t


@pytest.mark.slow
@pytest.mark.equivalence
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cnn_bn_steps_on_8_devices_equal_1_device(seed):
    """Each step on 8 devices from the state one device had before it: the
    params, loss and batch statistics of one device's step, for several seeds.
    The check's own uneven batch (43 rows, the last device holds 1): the
    README's `dpax check --model cnn-bn` then reads these compiled steps.
    (Two runs side by side drift apart on some seeds: the last bits of the
    global sums differ, and a max pool's near-tie can flip; see check.py.)"""
    ds = digits()
    result = dpax.check_equivalence(
        lambda: models.make_model("cnn-bn", ds.input_shape, ds.n_out, seed=seed),
        losses.classification_loss, ds.x_train, ds.y_train, devices=8, steps=3)
    print(result.report())
    assert result.equivalent and max(result.param_diff, result.state_diff) <= 1e-5


class BatchNormMLP(nnx.Module):
    """cnn-bn's BatchNorm and dropout after a dense layer: what micro-batching
    does to them does not depend on the convolutions, which are slow for
    XLA:CPU to compile."""

    def __init__(self, in_shape, n_out, *, rngs):
        self.dense = nnx.Linear(int(np.prod(in_shape)), 32, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(32, n_out, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn(self.dense(x.reshape(x.shape[0], -1))))
        return self.out(self.dropout(h))


@pytest.mark.equivalence
@pytest.mark.parametrize("n, grad_accum, seed", [(8, 3, 1)])  # 61 rows: uneven micro-batches
def test_batchnorm_with_grad_accum_steps_equal_1_device(n, grad_accum, seed):
    """A micro-batch's BatchNorm statistics cover the same examples on N devices
    as on one (every grad_accum-th row of the global batch), and each micro-batch
    updates the running averages in the same order (contiguous micro-batches
    fail this check)."""
    ds = digits()
    result = dpax.check_equivalence(
        lambda: BatchNormMLP(ds.input_shape, ds.n_out, rngs=nnx.Rngs(seed)),
        losses.classification_loss, ds.x_train, ds.y_train, devices=n, batch_size=61,
        steps=3, grad_accum=grad_accum)
    print(f"grad_accum {grad_accum}: {result.report()}")
    assert result.equivalent and max(result.param_diff, result.state_diff) <= 1e-5


@pytest.mark.slow
def test_cnn_bn_replicas_stay_in_sync_and_unsynced_statistics_differ():
    p1, s1, _ = train_cnn_bn(1, steps=3)
    _, _, t8 = train_cnn_bn(8, steps=3)
    assert dpax.pmap.replicas_in_sync(t8.state)
    pu, su, tu = train_cnn_bn(8, sync=False, steps=3)
    print(f"--no-sync-batchnorm: params {max_diff(pu, p1):.2e}, batch stats "
          f"{max_diff(su, s1):.2e}")
    assert max_diff(pu, p1) > 1e-3 and max_diff(su, s1) > 1e-3
    assert dpax.pmap.replicas_in_sync(tu.state)  # averaged running stats keep replicas equal


class DropoutMLP(nnx.Module):
    def __init__(self, in_shape, n_out, *, rngs):
        self.hidden = nnx.Linear(int(np.prod(in_shape)), 64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(64, n_out, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))))


def train_dropout(n, seed=0, backend="shard_map"):
    ds = digits()
    t = dpax.Trainer(DropoutMLP(ds.input_shape, ds.n_out, rngs=nnx.Rngs(0)),
                     losses.classification_loss, optax.sgd(0.1), devices=n, seed=seed,
                     backend=backend)
    t.fit(ds.x_train, ds.y_train, batch_size=61, until_step=10)
    return jax.tree.leaves(t.params)


@pytest.mark.slow
def test_dropout_masks_do_not_depend_on_the_device_count():
    ref = train_dropout(1)
    for n, backend in ((2, "shard_map"), (4, "pmap"), (8, "shard_map")):
        diff = max_diff(train_dropout(n, backend=backend), ref)
        print(f"dropout 0.5 MLP, {n} devices ({backend}) vs 1: {diff:.2e}")
        assert diff <= 1e-5
    assert max_diff(train_dropout(8, seed=1), ref) > 1e-3  # another seed, other masks


@pytest.mark.slow
def test_cnn_bn_trains_digits_and_resumes_exactly(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["train", "--model", "cnn-bn", "--checkpoint-dir", f"{a}/ck",
                 "--checkpoint-every", "135", "--log-every", "45", "--out", a]) == 0
    acc = float(capsys.readouterr().out.split("eval accuracy ")[1].split()[0])
    assert acc >= 0.97
    assert main(["train", "--model", "cnn-bn", "--resume", f"{a}/ck/135", "--log-every", "45",
                 "--out", b]) == 0
    pa, pb = np.load(f"{a}/params.npz"), np.load(f"{b}/params.npz")
    assert all(np.array_equal(pa[k], pb[k]) for k in pa.files)
    sa = dpax.cli.job.load_checkpoint(f"{a}/ck/180").trainer.state_dict()
    assert any(k.endswith("_bn.mean.value") for k in sa)  # batch stats are checkpointed


USER_MODELS = textwrap.dedent('''
    import jax, jax.numpy as jnp, optax
    from flax import nnx

    class MyBatchNorm(nnx.BatchNorm):
        """A user's own BatchNorm subclass: dpax leaves it alone, per device."""

    class BNNet(nnx.Module):
        def __init__(self, in_shape, n_out, *, rngs):
            self.dense = nnx.Linear(64, 32, rngs=rngs)
            self.bn = MyBatchNorm(32, rngs=rngs)
            self.out = nnx.Linear(32, n_out, rngs=rngs)
        def __call__(self, x):
            return self.out(nnx.relu(self.bn(self.dense(x.reshape(x.shape[0], -1)))))

    class RunningMean(nnx.Module):
        """Its own running mean of the rows it sees: per device, not a BatchNorm."""
        def __init__(self, in_shape, n_out, *, rngs):
            self.mean = nnx.BatchStat(jnp.zeros(64))
            self.out = nnx.Linear(64, n_out, rngs=rngs)
        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            self.mean[...] = 0.9 * self.mean[...] + 0.1 * x.mean(0)
            return self.out(x - self.mean[...])

    class KeyPerDevice(nnx.Module):
        """Draws its dropout mask from its own key: the same key on every device."""
        def __init__(self, in_shape, n_out, *, rngs):
            self.dense = nnx.Linear(64, 32, rngs=rngs)
            self.out = nnx.Linear(32, n_out, rngs=rngs)
            self.rngs = rngs.fork()
        def __call__(self, x):
            h = nnx.relu(self.dense(x.reshape(x.shape[0], -1)))
            keep = jax.random.bernoulli(self.rngs.dropout(), 0.5, h.shape)
            return self.out(jnp.where(keep, h * 2, 0.0))

    def mlp(in_shape, n_out, *, rngs):
        return nnx.Sequential(lambda x: x.reshape(x.shape[0], -1),
                              nnx.Linear(64, 32, rngs=rngs), nnx.relu,
                              nnx.Linear(32, n_out, rngs=rngs))

    def mean_loss(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def scaled_loss(model, batch):
        """One value per example, but scaled by the shard's mean: mixes examples."""
        l = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
        return l * l.mean()
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usermodels"
    sys.modules.pop("usermodels", None)


# deep-mlp is mlp, wider (47 s here); gpt and llama train on text (test_gpt.py
# and test_llama.py check them); cnn-bn is the README's check command (test_readme runs it).
@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(set(models.MODELS) - {"deep-mlp", "cnn-bn"}
                                         - set(models.registry.TEXT_MODELS)))
def test_check_passes_for_every_built_in_model(model, capsys):
    assert main(["check", "--model", model, "--devices", "8"]) == 0
    assert "\nequivalent (tolerance" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("flags,cause", [
    (["--factory", "usermodels:BNNet"], "unsynchronized batch statistics: bn"),
    (["--factory", "usermodels:RunningMean"], "per-device model state: mean.value"),
    (["--factory", "usermodels:mlp", "--loss", "usermodels:mean_loss"],
     "the loss averages per device"),
    (["--factory", "usermodels:mlp", "--loss", "usermodels:scaled_loss"],
     "the loss mixes examples"),
    (["--factory", "usermodels:KeyPerDevice"], "per-device RNG"),
])
def test_check_fails_and_names_the_cause(user_module, flags, cause, capsys):
    assert main(["check", "--devices", "8", *flags]) == 1
    out = capsys.readouterr().out
    assert "NOT equivalent: " + cause in out, out


def test_check_bad_factory_exits_2(capsys):
    assert main(["check", "--factory", "nosuchmodule:fn"]) == 2
    assert main(["check", "--factory", "no-colon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "cannot import" in err[0] and "MODULE:NAME" in err[1]


# -- a BatchNorm's own mask (padded steps of sequences) ------------------------------------
T = 6  # steps of a sequence; each example's real ones come first


def sequences(seed):
    """Sequences of 2-6 real steps; the padded steps hold 5.0, far from the
    real ones' mean, so statistics that count them are plainly off."""
    rng = np.random.default_rng(seed)
    real = np.arange(T)[None, :] < rng.integers(2, T + 1, (103, 1))
    x = np.where(real[..., None], rng.normal(size=(103, T, 4)), 5.0).astype(np.float32)
    return {"x": x, "real": real, "y": rng.integers(0, 3, 103)}


class MaskedSequences(nnx.Module):
    def __init__(self, rngs):
        self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x, real):
        h = self.bn(x, mask=real[..., None])
        return self.head((h * real[..., None]).sum(1) / real.sum(1, keepdims=True))


def masked_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(batch["x"], batch["real"]), batch["y"])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_batchnorms_own_mask_counts_as_it_does_without_dpax(seed):
    """nnx.BatchNorm(x, mask=...) leaves the masked positions out of its
    statistics; dpax's synchronized BatchNorm counted them, on 1 device and
    on N alike, silently unlike the user's model. Now one step's running
    mean is the user's model's own, and 3 devices train what one does; the
    same through Linen's nn.BatchNorm (it fell back to Linen's own layer,
    which the analysis then refused)."""
    from flax import linen

    data = sequences(seed)
    first = dpax.data.pipeline.BatchPlan(103, 29, seed=0).indices(0)
    plain = MaskedSequences(nnx.Rngs(seed))
    plain.train()
    plain(data["x"][first], data["real"][first])
    states = {}
    for n in (1, 3):
        m = MaskedSequences(nnx.Rngs(seed))
        t = dpax.Trainer(m, masked_loss, optax.sgd(0.0), devices=n)
        t.fit(data, batch_size=29, until_step=1)
        np.testing.assert_allclose(m.bn.mean[...], plain.bn.mean[...], atol=1e-6)
        t.fit(data, batch_size=29, until_step=4)
        states[n] = t.state_dict()
    assert max_diff(states[3], states[1]) <= 1e-5

    class Linen(linen.Module):
        @linen.compact
        def __call__(self, x, real, train: bool = False):
            h = linen.BatchNorm(use_running_average=not train, momentum=0.5)(
                x, mask=real[..., None])
            return linen.Dense(3)((h * real[..., None]).sum(1) / real.sum(1, keepdims=True))

    for n in (1, 3):
        m = dpax.from_linen(Linen(), data["x"][:1], data["real"][:1], seed=seed)
        t = dpax.Trainer(m, masked_loss, optax.sgd(0.1), devices=n)
        t.fit(data, batch_size=29, until_step=1)
        # The layer normalizes the inputs themselves: its statistics are the data's alone.
        np.testing.assert_allclose(m.wrapped.BatchNorm_0["mean"], plain.bn.mean[...],
                                   atol=1e-6)
        t.fit(data, batch_size=29, until_step=3)
        states[n] = t.state_dict()
    assert max_diff(states[3], states[1]) <= 1e-5
