"""A loss or model that computes with the number of rows a device holds
(`x.shape[0]`) is refused before training on several devices
(`dpax.analysis.batch_size`): each device holds 1/N of the batch, so such a
number is N times smaller there than on one device."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import Towers, check_loss_cli, max_diff
from dpax.analysis.batch_size import uses_rows_count
from dpax.errors import DpaxWarning, ReadsBatchSize

R = 6  # a device's rows
KEY = jax.random.key(0)  # a typed key, which NumPy cannot hold


def found(fn, not_judged=None):
    """`uses_rows_count` on fn(w, x, y): w (4, 3) alike on every device, x
    (R, 4) floats and y (R,) class ids the device's rows."""
    args = (jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((R, 4), jnp.float32),
            jax.ShapeDtypeStruct((R,), jnp.int32))
    return uses_rows_count(fn, args, (False, True, True), "d", 2, not_judged=not_judged)


@pytest.mark.parametrize("name,fn", [
    ("a per-example loss over the batch size",
     lambda w, x, y: jnp.tanh(x @ w).sum(1) / x.shape[0]),
    ("a per-token loss over batch x tokens",
     lambda w, x, y: jnp.tanh(x @ w).sum(1) / (x.shape[0] * x.shape[1])),
    ("weights of 1 / B",
     lambda w, x, y: jnp.tanh(x @ w).sum(1) * jnp.full(x.shape[0], 1 / x.shape[0])),
    ("a row's rank scaled by B", lambda w, x, y: jnp.arange(x.shape[0]) / x.shape[0] * x.sum(1)),
    ("a row's position in the shard", lambda w, x, y: x.sum(1) + jnp.arange(x.shape[0])),
    ("a table cut to the rows", lambda w, x, y: x.sum(1) + jnp.linspace(0, 1, 32)[:x.shape[0]]),
    ("a table looked up by row position",
     lambda w, x, y: x.sum(1) + jnp.linspace(0, 1, 32)[jnp.arange(x.shape[0])]),
    ("a table's entry at the rows' number",
     lambda w, x, y: x.sum(1) * jax.lax.dynamic_slice_in_dim(jnp.ones(32), x.shape[0], 1)),
    ("labels by position", lambda w, x, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w, jnp.arange(x.shape[0]) % 3)),
    ("jnp.take by position", lambda w, x, y: x.sum(1) * jnp.take(jnp.ones(9), jnp.arange(
        x.shape[0]))),
    ("a branch picked by the size",
     lambda w, x, y: jax.lax.switch(x.shape[0] % 2, [lambda v: v, lambda v: 2 * v], x.sum(1))),
    ("every other row", lambda w, x, y: jnp.where(jnp.arange(x.shape[0]) % 2 == 0, x.sum(1), 0.)),
    # Traced only with the number bounded below: `linspace` compares it with 1.
    ("a weight spread over the rows", lambda w, x, y: x.sum(1) * jnp.linspace(0, 1, x.shape[0])),
    ("a row weighted by its round of a scan over the rows", lambda w, x, y: jax.lax.scan(
        lambda c, r: (c + 1.0, r * (1 + 0.1 * c)), 0.0, x)[1].sum(1)),
    ("a key split each round of a scan over the rows", lambda w, x, y: jax.lax.scan(
        lambda k, r: (jax.random.split(k)[0], r * jax.random.uniform(k)), KEY, x)[1].sum(1)),
    # A reviewer's: a counter of shape (1,), a raw uint32 key, a body under
    # remat or jit, the rounds counted and read after the scan.
    ("a counter of shape (1,)", lambda w, x, y: jax.lax.scan(
        lambda c, r: (c + 1.0, r * (1 + 0.1 * c[0])), jnp.zeros(1), x)[1].sum(1)),
    ("a raw key split each round", lambda w, x, y: jax.lax.scan(
        lambda k, r: (jax.random.split(k)[0], r * jax.random.uniform(k)),
        jax.random.PRNGKey(0), x)[1].sum(1)),
    ("a counter in a body under remat", lambda w, x, y: jax.lax.scan(jax.checkpoint(
        lambda c, r: (c + 1.0, r * (1 + 0.1 * c))), 0.0, x)[1].sum(1)),
    ("a counter in a jitted body", lambda w, x, y: jax.lax.scan(jax.jit(
        lambda c, r: (c + 1.0, r * (1 + 0.1 * c))), 0.0, x)[1].sum(1)),
    ("the rounds of a scan over the rows, counted", lambda w, x, y: x.sum(1) / jax.lax.scan(
        lambda c, r: (c + 1.0, None), 0.0, x)[0]),
])
def test_a_value_from_the_number_of_rows_is_found(name, fn):
    where = found(fn)
    assert where is not None and "test_batch_size.py" in where, (name, where)


@pytest.mark.parametrize("name,fn", [
    ("a per-example loss",
     lambda w, x, y: optax.softmax_cross_entropy_with_integer_labels(x @ w, y)),
    ("the logit of each row's label", lambda w, x, y: (x @ w)[jnp.arange(x.shape[0]), y]),
    ("take_along_axis", lambda w, x, y: jnp.take_along_axis(x @ w, y[:, None], 1)[:, 0]),
    ("the last row (an index: the rows analysis judges it)", lambda w, x, y: x[-1] * x),
    ("an update of the last row", lambda w, x, y: x.at[-1].add(1.0).sum(1)),
    ("a mean over features", lambda w, x, y: (x @ w).mean(1)),
    ("a position along the features", lambda w, x, y: x * jnp.arange(x.shape[1])),
    ("a one-hot label", lambda w, x, y: (jax.nn.one_hot(y, 3) * (x @ w)).sum(1)),
    ("a loop over the rows, one a round", lambda w, x, y: jax.lax.fori_loop(
        0, x.shape[0], lambda i, acc: acc.at[i].set(jnp.tanh(x[i] @ w).sum()),
        jnp.zeros(x.shape[0]))),
    ("an argmax's accuracy", lambda w, x, y: (jnp.argmax(x @ w, -1) == y).astype(jnp.float32)),
    ("a reshape by the rows", lambda w, x, y: x.reshape(x.shape[0], 2, 2).sum((1, 2))),
    ("a slice of the rows' own values", lambda w, x, y: x[:, :2].sum(1) + x[: x.shape[0]].sum(1)),
    ("rows one by one by lax.map",
     lambda w, x, y: jax.lax.map(lambda r: jnp.tanh(r @ w), x).sum(1)),
    ("a scan over the rows passing a constant along", lambda w, x, y: jax.lax.scan(
        lambda c, r: (c, r * c), 2.0, x)[1].sum(1)),
    ("a counter of the rounds that nothing reads", lambda w, x, y: jax.lax.scan(
        lambda c, r: (c + 1.0, jnp.tanh(r)), 0.0, x)[1].sum(1)),
    ("a counter that picks each round's row back", lambda w, x, y: jax.lax.scan(
        lambda c, r: (c + 1, r * x[c].sum()), 0, x)[1].sum(1)),
    ("rows written into their places by a scan over them", lambda w, x, y: jax.lax.scan(
        lambda c, ir: (c.at[ir[0]].set(jnp.tanh(ir[1]).sum()), None), jnp.zeros(x.shape[0]),
        (jnp.arange(x.shape[0]), x))[0]),
])
def test_what_only_shapes_or_picks_by_the_rows_is_not_found(name, fn):
    assert found(fn) is None, name


# The symbolic trace fails on these (Python wants a number): the forward is
# traced at a device's rows and at all devices' instead, and a float constant
# of one only is found.
@pytest.mark.parametrize("name,fn", [
    ("len() of the rows", lambda w, x, y: x.sum(1) / len(x)),
    ("the rows' number as a Python float", lambda w, x, y: x.sum(1) / float(x.shape[0])),
    ("the rows' number to a power", lambda w, x, y: x.sum(1) / x.shape[0] ** 0.5),
    ("a Python if one device decides otherwise",
     lambda w, x, y: x.sum(1) * (2.0 if x.shape[0] > 2 * R - 1 else 1.0)),
    ("a loop over range(len(x)) weighting by position", lambda w, x, y: jnp.stack(
        [jnp.tanh(x[i] @ w).sum() * (i + 1.0) for i in range(len(x))])),
    ("a weight per row made with NumPy", lambda w, x, y: x.sum(1) * np.linspace(1, 2, len(x))),
    ("weights of 1 / B made with NumPy", lambda w, x, y: x.sum(1) * np.full(len(x), 1 / len(x))),
    # Found equation by equation in the two traces, or as a position among the rows:
    ("a power by len()", lambda w, x, y: x.sum(1) ** len(x)),
    ("a choice made by Python on len()",
     lambda w, x, y: x.sum(1) * jnp.where(len(x) > 2 * R - 1, 1.0, 0.5)),
    ("a branch picked by len()", lambda w, x, y: jax.lax.cond(
        len(x) > 2 * R - 1, lambda v: 2.0 * v, lambda v: v, x.sum(1))),
    ("a position by jnp.arange(len(x))", lambda w, x, y: x.sum(1) * (1 + jnp.arange(len(x)))),
    ("labels by jnp.arange(len(x))", lambda w, x, y: (
        optax.softmax_cross_entropy_with_integer_labels(x @ w, jnp.arange(len(x)) % 3))),
    ("every other row by len()",
     lambda w, x, y: jnp.where(jnp.arange(len(x)) % 2 == 0, x.sum(1), 0.0)),
    ("labels for half the batch made with NumPy", lambda w, x, y: x.sum(1) * np.concatenate(
        [np.ones(len(x) // 2), np.zeros(len(x) - len(x) // 2)])),
    ("a NumPy mask by position", lambda w, x, y: jnp.where(np.arange(len(x)) < 3, x.sum(1), 0.0)),
    # Multiples of the number that no axis is as long as are no size.
    ("twice the number, filled", lambda w, x, y: x.sum(1) * jnp.full(len(x), 2 * len(x))),
    ("a loop counting to twice the number", lambda w, x, y: x.sum(1) * jax.lax.fori_loop(
        0, 2 * len(x), lambda i, a: a + 1.0, 0.0)),
])
def test_a_number_python_reads_from_the_rows_is_found(name, fn):
    errors = []
    where = found(fn, errors.append)
    assert where is not None and "test_batch_size.py" in where and not errors, (name, where)


@pytest.mark.parametrize("name,fn", [
    ("a Python if every count decides alike",
     lambda w, x, y: x.sum(1) * (2.0 if x.shape[0] > 1 else 1.0)),
    ("labels picked by jnp.arange(len(y))",
     lambda w, x, y: jax.nn.log_softmax(x @ w)[jnp.arange(len(y)), y]),
    ("labels picked by np.arange", lambda w, x, y: jax.nn.log_softmax(x @ w)[
        np.arange(y.shape[0]), y]),
    ("zeros per row made with NumPy", lambda w, x, y: x.sum(1) + np.zeros(len(x))),
    ("a reshape by len()", lambda w, x, y: x.reshape(len(x), 2, 2).sum((1, 2))),
    ("a map over the rows' len()",
     lambda w, x, y: jax.lax.map(lambda r: jnp.tanh(r @ w).sum(), x.reshape(len(x), 4))),
    ("labels picked along len()'s rows", lambda w, x, y: jnp.take_along_axis(
        jax.nn.log_softmax(x @ w), y.reshape(len(y), 1), 1)[:, 0]),
    # Sizes that grow with the rows (their features': R * 4) are no count.
    ("a map over the rows' features, flattened", lambda w, x, y: jax.lax.map(
        jnp.tanh, x.reshape(len(x) * 4)).reshape(len(x), 4).sum(1)),
    ("each feature's own entry picked, flattened", lambda w, x, y: x.reshape(len(x) * 4)[
        jnp.arange(len(x) * 4)].reshape(len(x), 4).sum(1)),
    ("a weight per feature tiled per row with NumPy", lambda w, x, y: (x * np.tile(
        np.linspace(0, 1, 4), len(x)).reshape(len(x), 4)).sum(1)),
    ("a constant random key beside NumPy on the rows", lambda w, x, y: x.sum(1)
     + 0.1 * jax.random.normal(KEY, ()) + np.zeros(len(x))),
])
def test_what_python_only_shapes_by_the_rows_is_not_found(name, fn):
    errors = []
    assert found(fn, errors.append) is None and not errors, name


WEIGHTS = np.linspace(1.0, 2.0, 2 * R - 1)  # per-position weights, for fewer rows than one device's


@pytest.mark.parametrize("name,fn", [
    ("a table too short for one device's rows", lambda w, x, y: x.sum(1) * WEIGHTS[:len(x)]),
    # Unrolled, the two traces differ op for op: they are not compared.
    ("a loop over range(len(x)), one row a round",
     lambda w, x, y: jnp.stack([jnp.tanh(x[i] @ w).sum() for i in range(len(x))])),
])
def test_what_the_two_traces_cannot_compare_is_not_judged(name, fn):
    """The known blind spot (docs/exactness.md): a forward that traces with
    neither the symbol nor one device's rows, or whose two traces are not
    the same ops, is not judged; `not_judged` gets the symbolic trace's
    error."""
    errors = []
    assert found(fn, errors.append) is None
    assert len(errors) == 1 and isinstance(errors[0], Exception), errors


def test_what_traces_with_the_symbol_is_judged_without_a_word():
    traced = []
    assert found(lambda w, x, y: x.sum(1), traced.append) is None
    assert traced == []


def weighted_by_position(model, batch):
    """Each example's loss times a weight by its position in the batch, from
    a table of at most 9 positions (an error on one device's 16 rows)."""
    logits = model(batch["x"])
    weights = jnp.asarray(np.linspace(1.0, 2.0, 9)[:len(logits)])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) * weights


def test_a_loss_the_batch_size_check_cannot_read_trains_with_a_warning_naming_its_line():
    """Not judged is not silent: `Trainer.fit` warns, in one line naming the
    user's line, that N devices may train other params; a loss the check
    reads gets no warning."""
    x, y = data(0)
    t = dpax.Trainer(Net(nnx.Rngs(0)), weighted_by_position, optax.sgd(0.5), devices=2)
    with pytest.warns(DpaxWarning, match=r"cannot check .* \(at .*test_batch_size.py:\d+ "
                                        r"\(weighted_by_position\)") as caught:
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert all("\n" not in str(w.message) for w in caught)
    t = dpax.Trainer(Net(nnx.Rngs(0)), dpax.classification_loss, optax.sgd(0.5), devices=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DpaxWarning)
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)


def test_dpax_check_of_a_loss_it_cannot_read_warns_and_compares(tmp_path, monkeypatch, capsys):
    """Through the CLI: the warning, then the comparison's verdict (exit 1,
    NOT equivalent). Its search for a cause ran the loss on 16 rows, which a
    loss made for at most 13 cannot take: that was a TypeError (exit 1, a
    traceback in a file)."""
    assert check_loss_cli(tmp_path, monkeypatch, "thirteen:loss", (
        "import numpy as np\nimport optax\n\n\n"
        "def loss(model, batch):\n"
        "    logits = model(batch['x'])\n"
        "    weights = np.linspace(1.0, 2.0, 13)[:len(logits)]\n"
        "    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y']) * weights\n"
    )) == 1
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if "cannot check" in line]
    assert len(warned) == 1 and "thirteen.py:7 (loss)" in warned[0], captured.err
    assert "dpax: error" not in captured.err and "NOT equivalent" in captured.out, captured


def over_a_float_count(model, batch):
    """Each example's loss over the rows' number as a Python float."""
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) / float(
        logits.shape[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_loss_over_a_python_float_count_is_refused(seed, monkeypatch):
    """`float(x.shape[0])` does not trace with a symbol: the traces at two
    counts find it, and refuse it naming the user's line; unrefused, it
    trained 2 devices 0.013 and 0.015 from one (seeds 0, 1)."""
    refused_where_unrefused_differs(
        lambda n: params_after(n, seed, loss=over_a_float_count), "test_batch_size.py",
        monkeypatch)


def weighted_by_round(model, batch):
    """Each example's loss weighted by its round of a scan over the rows:
    its position in the device's shard (a reviewer's)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return jax.lax.scan(lambda c, loss: (c + 1.0, loss * (1 + 0.1 * c)), 0.0, losses)[1]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_weight_by_the_round_of_a_scan_over_the_rows_is_refused(seed, monkeypatch):
    refused_where_unrefused_differs(
        lambda n: params_after(n, seed, loss=weighted_by_round), "test_batch_size.py",
        monkeypatch)


def refused_where_unrefused_differs(params_of, where: str, monkeypatch):
    """`params_of(2)` is refused naming `where`; with the analysis off, it
    trains other params than `params_of(1)`: the refusal guards a real
    difference."""
    one = params_of(1)
    with pytest.raises(ReadsBatchSize, match=where):
        params_of(2)
    monkeypatch.setattr(dpax.analysis.refusals, "uses_rows_count", lambda *a, **k: None)
    diff = max_diff(one, params_of(2))
    assert diff > 1e-3, diff


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l(x)


def mean_scaled(model, batch):
    """A per-example loss, "normalized" by the device's batch size."""
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) / logits.shape[0]


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(30, 8)).astype(np.float32), rng.integers(0, 3, 30).astype(np.int32)


def params_after(n, seed, loss=mean_scaled):
    x, y = data(seed)
    t = dpax.Trainer(Net(nnx.Rngs(seed)), loss, optax.sgd(0.5), devices=n)
    t.fit(x, y, batch_size=15, until_step=2, log_every=10**9)
    return t.params


@pytest.mark.parametrize("seed", [0, 1])
def test_a_loss_over_the_batch_size_is_refused_on_several_devices(seed, monkeypatch):
    """One device trains the loss as written. On 2 devices it is refused,
    in one line naming the user's line, before anything changes; with the
    analysis off, the 2 devices would have trained other params (with SGD
    the loss, and so the step, is 2x one device's: 15 rows padded to 16)."""
    one = params_after(1, seed)
    x, y = data(seed)
    t = dpax.Trainer(Net(nnx.Rngs(seed)), mean_scaled, optax.sgd(0.5), devices=2)
    before = t.params
    with pytest.raises(ReadsBatchSize, match="number of rows a device holds") as e:
        t.fit(x, y, batch_size=15, until_step=2, log_every=10**9)
    assert "\n" not in str(e.value) and "test_batch_size.py" in e.value.where
    assert int(t.state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, before, t.params)

    monkeypatch.setattr(dpax.analysis.refusals, "uses_rows_count", lambda *a, **k: None)
    unrefused = params_after(2, seed)
    diff = max_diff(one, unrefused)
    assert diff > 1e-3, diff


class NoisyNet(nnx.Module):
    """Noise drawn from the model's own stream in a fixed shape, cut to the
    batch: row i gets noise row i, its position in the device's shard."""

    def __init__(self, rngs):
        self.l = nnx.Linear(8, 3, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        noise = jax.random.normal(self.rngs.noise(), (64, 8))[: x.shape[0]]
        return self.l(x + 0.5 * noise)


def ce(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


@pytest.mark.parametrize("seed", [0, 1])
def test_noise_cut_to_the_batch_is_refused(seed, monkeypatch):
    """The draw's shape does not follow the rows (`dpax.analysis.varying`
    judges those); the slice does. Without the refusal 2 devices trained
    other params than one."""
    x, y = data(seed)

    def params_of(n):
        t = dpax.Trainer(NoisyNet(nnx.Rngs(seed, noise=seed + 1)), ce, optax.sgd(0.5),
                         devices=n)
        t.fit(x, y, batch_size=15, until_step=2, log_every=10**9)
        return t.params

    refused_where_unrefused_differs(params_of, "test_batch_size.py", monkeypatch)


class NormNet(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.l(x))))


def test_a_batchnorm_model_is_read_too():
    """dpax's synchronized BatchNorm sums the rows exactly, a loop over their
    number: the symbolic trace takes a plain sum there, so such a model is
    judged (and refused with this loss), not skipped."""
    x, y = data(0)
    t = dpax.Trainer(NormNet(nnx.Rngs(0)), mean_scaled, optax.sgd(0.5), devices=2)
    with pytest.raises(ReadsBatchSize, match="test_batch_size.py"):
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)


@pytest.mark.parametrize("options", [
    {"backend": "pmap"}, {"grad_accum": 3}, {"sharding": "full"},
    {"sharding": "full", "replicas": 2}])
def test_the_refusal_holds_on_every_backend_and_layout(options):
    """4 devices; with replicas the rows span two mesh axes."""
    x, y = data(0)
    t = dpax.Trainer(Net(nnx.Rngs(0)), mean_scaled, optax.sgd(0.5), devices=4, **options)
    with pytest.raises(ReadsBatchSize, match="on 4 devices"):
        t.fit(x, y, batch_size=20, until_step=1, log_every=10**9)


def test_per_device_statistics_asked_for_are_not_checked():
    """`sync_batchnorm=False` asks for per-device batch statistics, which
    divide by a device's number of rows: that is not refused (nor anything
    else that reads the number), as mixed rows are not."""
    x, y = data(0)
    t = dpax.Trainer(Net(nnx.Rngs(0)), mean_scaled, optax.sgd(0.5), devices=2,
                     sync_batchnorm=False)
    t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert int(t.state.step) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fix_the_refusal_names_trains_as_one_device(seed):
    """Each example's own loss, weighted by the third output (here each
    example's label + 1): 2 and 4 devices train one device's params."""
    def weighted(model, batch):
        return ce(model, batch), {}, batch["y"] + 1.0

    one = params_after(1, seed, weighted)
    for n in (2, 4):
        diff = max_diff(one, params_after(n, seed, weighted))
        assert diff < 1e-6, (n, diff)


def test_check_names_the_batch_size():
    x, y = data(0)
    result = dpax.check_equivalence(lambda: Net(nnx.Rngs(0)), mean_scaled, x, y, devices=2,
                                    steps=1)
    assert result.cause == "batch-size" and "test_batch_size.py" in result.report()


def test_dpax_check_names_the_line_of_a_loss_over_the_batch_size(tmp_path, capsys, monkeypatch):
    """Through the CLI: `dpax check --loss MODULE:FN` exits 1 and says why."""
    assert check_loss_cli(tmp_path, monkeypatch, "batchlosses:per_batch", (
        "import optax\n\n\n"
        "def per_batch(model, batch):\n"
        "    logits = model(batch['x'])\n"
        "    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])\n"
        "    return ce / batch['x'].shape[0]\n")) == 1
    out = capsys.readouterr().out
    assert "NOT equivalent: the loss or the model computes with the number of rows" in out
    assert "batchlosses.py:7" in out


def _global_logits(model, batch):
    from dpax.models.layers import global_rows

    za, zb = model(batch["x"])
    others, real = global_rows(zb)  # every device's rows: N * rows, the global order
    return jnp.where(real, za @ others.T, -1e9), others.shape[0]


def clip_one_hot(model, batch):
    logits, g = _global_logits(model, batch)
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["index"], g))


def clip_eye(model, batch):
    logits, g = _global_logits(model, batch)
    return optax.softmax_cross_entropy(logits, jnp.eye(g)[batch["index"]])


def not_self(model, batch):
    logits, g = _global_logits(model, batch)
    others = batch["index"][:, None] != jnp.arange(g)[None, :]
    return jax.nn.logsumexp(jnp.where(others, logits, -1e9), -1) - jnp.take_along_axis(
        logits, batch["index"][:, None], 1)[:, 0]


@pytest.mark.parametrize("loss", [clip_one_hot, clip_eye, not_self])
def test_positions_along_the_global_batch_are_not_refused(loss):
    """A position along `global_rows`' rows (`N * rows` of them, in the
    global batch's order) is the example's own in the batch: such losses
    train on 2 devices what they train on one (15 rows, one padded)."""
    x, _ = data(0)

    def params_of(n):
        t = dpax.Trainer(Towers(nnx.Rngs(0)), loss, optax.sgd(0.5), devices=n)
        t.fit(x, np.zeros(30, np.int32), batch_size=15, until_step=2, log_every=10**9)
        return t.params

    one, two = params_of(1), params_of(2)
    diff = max_diff(one, two)
    assert diff < 2e-6, diff


def clip_by_position(model, batch):
    """CLIP as often written for one device: labels jnp.arange(rows), which
    over `global_rows`' columns are the first rows of the global batch."""
    logits, _ = _global_logits(model, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(logits.shape[0]))


def test_labels_by_position_over_the_global_batch_are_refused(monkeypatch):
    x, _ = data(0)

    def params_of(n):
        t = dpax.Trainer(Towers(nnx.Rngs(0)), clip_by_position, optax.sgd(0.5), devices=n)
        t.fit(x, np.zeros(30, np.int32), batch_size=15, until_step=2, log_every=10**9)
        return t.params

    refused_where_unrefused_differs(params_of, "clip_by_position", monkeypatch)
