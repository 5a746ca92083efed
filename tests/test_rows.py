"""A loss or layer that mixes the examples a device holds is refused before
training (`dpax.analysis.rows`); a loss over the whole batch written with
`global_rows` trains on N devices what it trains on one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import ClosedJaxpr

import dpax
import dpax.analysis.refusals
from conftest import Towers, max_diff
from dpax.analysis.rows import CONST, SUMMARY, UNKNOWN, Mixed, OneRow, Row, mixing
from dpax.errors import MixesExamples
from dpax.models.layers import global_rows

R = 6  # a device's rows


def kinds(fn, *shapes, rows=None, axis_size=2):
    """The kinds of fn's outputs; the first argument holds rows unless `rows` says."""
    rows = rows or [True] + [False] * (len(shapes) - 1)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    closed = jax.make_jaxpr(fn, axis_env=[("d", axis_size)])(*args)
    return mixing(closed.jaxpr, rows, closed.consts)


@pytest.mark.parametrize("name,fn", [
    ("x - mean over the batch", lambda x: x - x.mean(0)),
    ("x @ x.T (pairs of examples)", lambda x: (x @ x.T).sum(1)),
    ("cumsum over the rows", lambda x: jnp.cumsum(x, 0)),
    ("sort over the rows", lambda x: jnp.sort(x, 0)),
    ("reversed rows", lambda x: x[::-1]),
    ("scaled by the batch's loss", lambda x: x.sum(1) * x.sum()),
    ("rolled rows", lambda x: x * jnp.roll(x, 1, axis=0)),
    ("each row times the next", lambda x: x[1:] * x[:-1]),
    ("each row less the one before", lambda x: x[1:] - x[:-1]),
    ("jnp.diff over the rows", lambda x: jnp.diff(x, axis=0)),
    ("each row plus the one two on", lambda x: x[2:] + x[:-2]),
    ("the hardest half by top_k (OHEM)", lambda x: jax.lax.top_k(x.sum(1), R // 2)[0]),
    ("the hardest half by approx_max_k", lambda x: jax.lax.approx_max_k(x.sum(1), R // 2)[0]),
    ("jnp.diff over the rows, a constant in front",
     lambda x: jnp.diff(x, axis=0, prepend=0.0)),
    ("each row less the one before, padded in front",
     lambda x: x - jnp.pad(x, ((1, 0), (0, 0)))[:-1]),
    ("a product of the halves", lambda x: jnp.maximum(x[:3], x[3:])),
    ("halves swapped", lambda x: x - jnp.concatenate(jnp.split(x, 2)[::-1])),
    ("a row picked by every row", lambda x: x - x[jnp.argmax(x[:, 0])]),
    ("a column picked by every row", lambda x: x[:, jnp.argmax(x.sum(0))] * x[:, 0]),
    ("rows in a random order (mixup)",
     lambda x: x + x[jax.random.permutation(jax.random.key(0), R)]),
    ("rows shuffled as an array", lambda x: jax.random.permutation(jax.random.key(0), x)),
    ("rows drawn at random", lambda x: jnp.take(x, jax.random.randint(
        jax.random.key(0), (R,), 0, R), axis=0)),
    ("two rows swapped by a fixed index", lambda x: jnp.take(x, jnp.array([1, 0, 2, 3, 4, 5]),
                                                              axis=0)),
    ("labels' log-probabilities of the rows reversed", lambda x: jax.nn.log_softmax(x)[
        jnp.arange(R)[::-1], jnp.argmax(x, 1)]),
    ("every row less the first", lambda x: x - x[0]),
    ("every row but the first against the first", lambda x: x[1:] @ x[0]),
    ("every row against the first as a column", lambda x: x @ x[0][:, None]),
    ("every row less the first, repeated", lambda x: x - jnp.repeat(x[0][None], R, 0)),
    ("every row less two rows' mean", lambda x: x - (x[0] + x[1]) / 2),
    ("the first row where a row's feature says", lambda x: jnp.where(x[:, :1] > 0, x, x[0])),
    ("every row less the first, scanned out", lambda x: x - jax.lax.scan(
        lambda c, _: (c, x[0]), 0.0, None, length=R)[1]),
    ("other devices' rows in place", lambda x: x - jax.lax.ppermute(x, "d", [(0, 1), (1, 0)])),
    ("a table entry picked by the first row", lambda x: x + jnp.arange(10.0)[
        jnp.argmax(x[0])]),
    ("each device's first run of rows summed over the devices",
     lambda x: x - jax.lax.psum(x[0:1], "d")),
    ("the first row's features beside every row's", lambda x: jnp.concatenate(
        [x, jnp.broadcast_to(x[0], x.shape)], 1)),
    ("a row's value beside the rows' mean", lambda x: jnp.where(x[2:3] > 0, x[2], x.mean(0))),
    ("each device's first row, summed over the devices", lambda x: x - jax.lax.psum(x[0], "d")),
    ("every row scaled by the last one's sum", lambda x: x * x[-1].sum()),
    ("every row against the first", lambda x: x @ x[0]),
    ("kept where the first row is positive", lambda x: jnp.where(x[0] > 0, x, 0.0)),
    ("rows one by one, stacked in another order",
     lambda x: jnp.stack([jnp.tanh(x[i]) for i in reversed(range(R))])),
    ("each row with the next, the last clamped",
     lambda x: x * x.at[jnp.arange(R) + 1].get(mode="clip")),
    ("rows picked one by one at random under vmap (mixup)", lambda x: x + jax.vmap(
        lambda i: x[i])(jax.random.permutation(jax.random.key(0), R))),
    ("rows written at random places (mixup)", lambda x: jnp.zeros_like(x).at[
        jax.random.permutation(jax.random.key(0), R)].set(x)),
    ("every row's features from the first row",
     lambda x: jnp.take_along_axis(x, jnp.zeros((R, 4), jnp.int32), axis=0)),
    ("a scan over the rows whose carry runs from row to row", lambda x: jax.lax.scan(
        lambda c, r: (c + r.sum(), r * (1 + 0.01 * c)), jnp.zeros_like(x[0, 0]), x)[1]),
    ("a scan over the rows that returns the rows so far", lambda x: jax.lax.scan(
        lambda c, r: (c + r, c), jnp.zeros_like(x[0]), x)[1]),
    ("every row less the rows' sum, carried by a scan", lambda x: x - jax.lax.scan(
        lambda c, r: (c + r, None), jnp.zeros_like(x[0]), x)[0]),
])
def test_mixing_ops_are_found(name, fn):
    (kind, *_) = kinds(fn, (R, 4))
    assert isinstance(kind, Mixed), (name, kind)
    assert "test_rows.py" in kind.where  # the user's line is named


def test_a_difference_of_runs_mixes_even_where_they_share_no_row():
    """With 2 rows a device, x[1:] and x[:-1] are disjoint, as a pairwise
    sum's halves are; a difference is no part of a sum (0.0231 from one
    device on 4 devices, a reviewer's measure)."""
    (kind,) = kinds(lambda x: x[1:] - x[:-1], (2, 4))
    assert isinstance(kind, Mixed), kind
    (kind,) = kinds(lambda x: x[:1] + x[1:], (2, 4))
    assert kind == UNKNOWN  # the pairwise sum's first level: not read


@pytest.mark.parametrize("name,fn,expected", [
    ("per-example mse", lambda x, w: jnp.mean((x @ w) ** 2, -1), Row(0)),
    ("a sum over the rows", lambda x, w: (x @ w).sum(0), SUMMARY),
    ("synchronized centring", lambda x, w: x - jax.lax.psum(x.sum(0), "d") / 12, Row(0)),
    ("all-gathered rows", lambda x, w: jax.lax.all_gather(x, "d", tiled=True), CONST),
    ("tokens merged with the rows and back",
     lambda x, w: jnp.tanh(x.reshape(R * 2, 2) @ w[:2]).reshape(R, 2, -1).sum((1, 2)), Row(0)),
    ("transposed twice", lambda x, w: jnp.transpose(x.T * 2), Row(0)),
    ("broadcast by a size-1 axis", lambda x, w: x + w.T[:1], Row(0)),
    ("halves computed apart, back in order",
     lambda x, w: jnp.concatenate([jnp.tanh(x[:2] @ w), jnp.exp(x[2:] @ w)]), Row(0)),
    ("split and put back", lambda x, w: jnp.concatenate(jnp.split(x, 3)) @ w, Row(0)),
    ("some rows", lambda x, w: (x[1:4] @ w).sum(1), Row(0, span=(1, 4, R))),
    ("the same rows paired", lambda x, w: jnp.einsum("bi,bi->b", x[:3], x[:3]),
     Row(0, span=(0, 3, R))),
    ("some rows flattened", lambda x, w: x[:3].reshape(3, 2, 2).sum((1, 2)),
     Row(0, span=(0, 3, R))),
    ("a choice over the rows on a whole axis (not read)",
     lambda x, w: jax.lax.dynamic_slice(x, (jnp.argmax(x[:, 0]), 0), (R, 4)), UNKNOWN),
    ("some rows' sum (not read)", lambda x, w: x[1:].sum(0), UNKNOWN),
    ("rolled by nothing", lambda x, w: jnp.roll(x, 0, axis=0) @ w, Row(0)),
    ("a row at a time, each with itself, back in order", lambda x, w: jnp.concatenate(
        [jnp.sum(c @ c.T, 1) + jnp.cumsum(c, 0)[:, 0] for c in jnp.split(x, R)]), Row(0)),
    ("some rows twice (not read)", lambda x, w: jnp.concatenate([x[:3], x[:3]]), UNKNOWN),
    ("two runs of rows paired (not read)", lambda x, w: jnp.einsum("bi,bi->b", x[:3], x[3:]),
     UNKNOWN),
    ("some rows contracted (not read)", lambda x, w: x[:3].T @ x[:3], UNKNOWN),
    ("some rows' features picked (not read)", lambda x, w: jnp.take_along_axis(
        x[:3], jnp.zeros((3, 1), jnp.int32), axis=1), UNKNOWN),
    ("some rows merged (not read)", lambda x, w: x[:4].reshape(2, -1), UNKNOWN),
    ("some rows scanned along their features", lambda x, w: jax.lax.scan(
        lambda c, col: (c + col, c * col), jnp.zeros(3), x[:3].T)[1].T.sum(1),
     Row(0, span=(0, 3, R))),
    ("the halves added (a pairwise sum, not read)", lambda x, w: x[:3] + x[3:], UNKNOWN),
    ("a row's two largest features (top_k along them)",
     lambda x, w: jax.lax.top_k(x @ w, 2)[0].sum(1), Row(0)),
    ("rows gathered in order", lambda x, w: x[jnp.arange(R)] @ w, Row(0)),
    ("rows gathered in order by a NumPy index", lambda x, w: x[np.arange(R)] @ w, Row(0)),
    ("rows gathered in order from the end", lambda x, w: x[jnp.arange(-R, 0)] @ w, Row(0)),
    ("a run of rows gathered", lambda x, w: x[jnp.arange(1, 4)] @ w, Row(0, span=(1, 4, R))),
    ("each row gathered twice in place", lambda x, w: x[jnp.arange(2 * R) // 2] @ w,
     Row(0, group=2)),
    ("labels looked up in a constant table", lambda x, w: jnp.asarray(
        np.array([0, 0, 1, 1, 2, 2]))[jnp.argmax(x, 1)], Row(0)),
    ("a random subset of the features, the same for every row (MAE)", lambda x, w: x[
        jnp.arange(R)[:, None], jax.random.permutation(jax.random.key(0), 4)[None, :2]],
     Row(0)),
    ("each row's last entry, the rows flattened", lambda x, w: x.reshape(R * 4)[
        jnp.arange(R) * 4 + 3], Row(0)),
    ("rows picked one by one in order under vmap",
     lambda x, w: jax.vmap(lambda i: x[i])(jnp.arange(R)) @ w, Row(0)),
    ("rows gathered in order inside a jit", lambda x, w: jax.jit(
        lambda z: z[np.arange(z.shape[0])])(x) @ w, Row(0)),
    ("every other row by index (not read)", lambda x, w: x[jnp.arange(0, R, 2)], UNKNOWN),
    ("the rows twice over by index (not read)", lambda x, w: x[jnp.tile(jnp.arange(R), 2)],
     UNKNOWN),
    ("rows picked by an index not evaluated (not read)",
     lambda x, w: x[jnp.cumsum(jnp.ones(R, jnp.int32)) - 1], UNKNOWN),
    ("a column written into the rows", lambda x, w: x.at[:, 0].set(x[:, 1] * 2), Row(0)),
    ("a sum by segments of the rows (not read)", lambda x, w: jax.ops.segment_sum(
        x, jnp.arange(R) // 2, num_segments=R), UNKNOWN),
    ("each row's label's log-probability, by position", lambda x, w: jax.nn.log_softmax(x)[
        jnp.arange(R), jnp.argmax(x, 1)], Row(0)),
    ("each token's label's log-probability, by position", lambda x, w: jax.nn.log_softmax(
        x.reshape(R, 2, 2))[jnp.arange(R)[:, None], jnp.arange(2)[None], jnp.argmax(
            x.reshape(R, 2, 2), -1)], Row(0)),
    ("a feature per row", lambda x, w: jnp.take_along_axis(
        x, jnp.zeros((R, 1), jnp.int32), axis=1), Row(0)),
    ("rows one by one, stacked back in order",
     lambda x, w: jnp.stack([(x[i] - x[i].mean()) / x[i].std() for i in range(R)]) @ w, Row(0)),
    ("rows one by one, put back in order",
     lambda x, w: jnp.concatenate([x[i][None] * x[i].sum() for i in range(R)]) @ w, Row(0)),
    ("some rows one by one, stacked", lambda x, w: jnp.stack([x[i] for i in range(2, 4)]) @ w,
     Row(0, span=(2, 4, R))),
    ("a row with itself", lambda x, w: x[2:3] * x[2], Row(0, span=(2, 3, R))),
    ("the first row alone", lambda x, w: x[0] @ w, OneRow(0, R)),
    ("two rows together", lambda x, w: x[0] * x[1], SUMMARY),
    ("rows one by one, written into their places (not read)",
     lambda x, w: _in_place(x, lambda out, i, v: out.at[i].set(v)) - x, UNKNOWN),
    ("rows one by one, chosen into their places (not read)", lambda x, w: _in_place(
        x, lambda out, i, v: jnp.where((jnp.arange(R) == i)[:, None], v, out)) - x, UNKNOWN),
    ("two rows' values side by side (not read)",
     lambda x, w: x + jnp.concatenate([x[0], x[-1]])[:4], UNKNOWN),
    ("random rows zeroed (not read)", lambda x, w: x.at[
        jax.random.permutation(jax.random.key(0), R)[:2]].set(0.0), UNKNOWN),
    ("a random subset of the features zeroed in every row (not read)", lambda x, w: x.at[
        jnp.arange(R)[:, None], jax.random.permutation(jax.random.key(0), 4)[None, :2]].set(0.0),
     UNKNOWN),
    ("a row's value through a scan", lambda x, w: jax.lax.scan(
        lambda c, t: (c, t[None].sum()), 0.0, x[0][:, None] + w[:1])[1], OneRow(0, R)),
    ("rows written under vmap at places drawn alike for every row (not read)",
     lambda x, w: jax.vmap(lambda r, p: jnp.zeros(4).at[p].set(r))(x, jnp.broadcast_to(
         jax.random.permutation(jax.random.key(0), 4), x.shape)), UNKNOWN),
    ("rows' entries written at drawn places, the rows flattened (not read)",
     lambda x, w: jnp.zeros((R, 6)).at[jnp.repeat(jnp.arange(R), 4), jnp.broadcast_to(
         jax.random.permutation(jax.random.key(0), 6)[:4], (R, 4)).ravel()].set(x.ravel()),
     UNKNOWN),
    ("the rows summed over the devices, then over the rows",
     lambda x, w: x - jax.lax.psum(x, "d").sum(0), Row(0)),
    ("rows one by one, placed by an outer product with a one-hot (not read)", lambda x, w: sum(
        jnp.einsum("r,f->rf", jax.nn.one_hot(i, R), jnp.tanh(x[i])) for i in range(R)) - x,
     UNKNOWN),
    ("no row picked (not read)",
     lambda x, w: jax.vmap(lambda i: x[i])(jnp.zeros(0, jnp.int32)), UNKNOWN),
    ("the first row written back in place (not read)", lambda x, w: x.at[0].set(x[0] * 2),
     UNKNOWN),
    ("a scan along each row's features, row by row", lambda x, w: jax.lax.map(
        lambda r: jax.lax.scan(lambda c, e: (jnp.tanh(c + e), c), jnp.zeros_like(r[0]), r)[1],
        x), Row(0)),
    ("the carry of a scan along each row's features, row by row", lambda x, w: jax.lax.map(
        lambda r: r * jax.lax.scan(lambda c, e: (c + e, None), 0.0, r)[0], x), Row(0)),
    ("rows one by one by lax.map", lambda x, w: jax.lax.map(
        lambda r: jnp.tanh(r @ w) * r[0], x), Row(0)),
    # No row meets another; the round's count is a row's position, which the
    # batch-size refusal finds (tests/test_batch_size.py).
    ("a scan over the rows counting its rounds", lambda x, w: jax.lax.scan(
        lambda c, r: (c + 1.0, r * c), 0.0, x)[1] @ w, Row(0)),
    ("a scan over the rows, each written into its place (not read)", lambda x, w: jax.lax.scan(
        lambda c, ir: (c.at[ir[0]].set(jnp.tanh(ir[1])), None), jnp.zeros_like(x),
        (jnp.arange(R), x))[0] - x, UNKNOWN),
    ("a while loop (not read)", lambda x, w: jax.lax.while_loop(
        lambda c: c[1] < 3, lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0], UNKNOWN),
])
def test_row_local_math_keeps_its_rows(name, fn, expected):
    assert kinds(fn, (R, 4), (4, 3))[0] == expected, name


def _in_place(x, write):
    """Rows one by one (`f(x[i])`), each written into its place of zeros."""
    out = jnp.zeros_like(x)
    for i in range(R):
        out = write(out, i, jnp.tanh(x[i]))
    return out


def _centred(x):
    return x - x.mean(0)


_custom_centred = jax.custom_vjp(_centred)
_custom_centred.defvjp(lambda x: (_centred(x), None), lambda _, g: (g,))


@pytest.mark.parametrize("name,fn,mixes", [
    ("x - mean over the batch", _centred, True),
    ("x @ x.T (pairs of examples)", lambda x: (x @ x.T).sum(1), True),
    ("cumsum over the rows", lambda x: jnp.cumsum(x, 0), True),
    ("sort over the rows", lambda x: jnp.sort(x, 0), True),
    ("scaled by the batch's loss", lambda x: x.sum(1) * x.sum(), True),
    # Its JVP multiplies runs of the rows paired by position.
    ("scaled by a product over the rows", lambda x: x * jnp.prod(x, 0), True),
    ("centred under remat", jax.checkpoint(_centred), True),
    ("centred in a custom_vjp", _custom_centred, True),
    ("centred in a jit", jax.jit(_centred), True),
    ("per-example tanh", lambda x: jnp.tanh(x).sum(1), False),
    ("per-example softmax", lambda x: jax.nn.log_softmax(x).sum(1), False),
    ("per-example scan", lambda x: jax.lax.scan(lambda c, r: (c + r, c * r), 0.0 * x[:, 0],
                                                x.T)[1].T, False),
    ("synchronized centring", lambda x: x - jax.lax.psum(x.sum(0), "d") / 12, False),
])
def test_the_step_reads_the_gradients_trace_as_the_forwards(name, fn, mixes):
    """The step's preflight reads the forward's part of the gradient's trace
    (`dpax.training.step._value_part`), where JAX writes a custom_jvp as its
    rule, a custom_vjp as its forward, and jit, remat and scan with the
    residuals they keep for the backward pass: each verdict is the one the
    forward's own trace gives."""
    from dpax.training.step import _value_part

    def forward(w, x):
        out = fn(x * w)
        return jnp.sum(out), out

    w, x = jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((R, 4), jnp.float32)
    grad = jax.make_jaxpr(jax.value_and_grad(forward, has_aux=True), axis_env=[("d", 2)])(w, x)
    read = mixing(_value_part(grad.jaxpr, 1), [False, True])
    own = mixing(jax.make_jaxpr(forward, axis_env=[("d", 2)])(w, x).jaxpr, [False, True])
    assert isinstance(own[1], Mixed) == mixes, (name, own)
    assert [type(k) for k in read] == [type(k) for k in own], name
    assert [k for k in read if not isinstance(k, Mixed)] == [
        k for k in own if not isinstance(k, Mixed)], name


@pytest.mark.parametrize("name,fn", [
    ("cummax over the rows", lambda x: jax.lax.cummax(x, 0)),
    ("cumprod over the rows", lambda x: jnp.cumprod(x, 0)),
])
def test_what_the_gradients_trace_hides_is_read_from_the_forward(name, fn):
    """JAX writes these ops' JVPs as slices, pads and scans that the analysis
    does not read (`UNKNOWN`), so they trained on N devices unrefused: where
    the gradient's trace holds anything unread, the refusals read the
    forward's own trace, whose ops mix the rows."""
    from dpax.analysis.refusals import Asks, refuse
    from dpax.training.step import _value_part

    def forward(w, state, x):
        out = fn(x * w)
        return jnp.sum(out), out

    args = (jax.ShapeDtypeStruct((4,), jnp.float32), {},
            jax.ShapeDtypeStruct((R, 4), jnp.float32))
    grad = jax.make_jaxpr(jax.value_and_grad(forward, has_aux=True), axis_env=[("d", 2)])(*args)
    part = _value_part(grad.jaxpr, 1)
    assert UNKNOWN in mixing(part, [False, True])
    with pytest.raises(MixesExamples, match=name.split()[0].replace("scaled", "mul")):
        refuse(forward, args, "d", 2, Asks(), jaxpr=ClosedJaxpr(part, grad.consts))


def test_lookups_convolutions_and_scans_keep_rows():
    table = jnp.ones((10, 4))

    def embed_conv_scan(ids, kernel):
        h = jnp.take(table, ids.astype(jnp.int32), axis=0)  # (R, 5, 4)
        h = jax.lax.conv_general_dilated(h, kernel, (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"))
        h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c * w), None), h, jnp.ones((3, 4)))
        logp = jax.nn.log_softmax(h.mean(1))
        return optax.softmax_cross_entropy_with_integer_labels(
            logp, ids[:, 0].astype(jnp.int32))

    assert kinds(embed_conv_scan, (R, 5), (3, 4, 4)) == [Row(0)]


# -- in the Trainer ------------------------------------------------------------------------
def in_batch(model, batch):
    """A contrastive loss as written for one device: every other example of
    the batch is a negative."""
    za, zb = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(za @ zb.T, jnp.arange(len(za)))


def whole_batch(model, batch):
    """The same loss on N devices: the negatives are every device's rows."""
    za, zb = model(batch["x"])
    others, real = global_rows(zb)
    logits = jnp.where(real, za @ others.T, -jnp.inf)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["index"])


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(45, 8)).astype(np.float32), np.zeros(45, np.int32)


def train(loss, n, seed, steps=4, **options):
    x, y = data(seed)
    t = dpax.Trainer(Towers(nnx.Rngs(seed)), loss, optax.adam(1e-2), devices=n, **options)
    t.fit(x, y, batch_size=15, until_step=steps, log_every=10**9)
    return t


def labels_by_position(model, batch):
    """Each example's log-probability of its label, picked by its position."""
    logp = jax.nn.log_softmax(model(batch["x"])[0])
    return -logp[jnp.arange(logp.shape[0]), batch["y"]]


def test_a_label_picked_by_position_is_read_from_the_gradients_trace(monkeypatch):
    """`logp[jnp.arange(n), y]` picks each row's own entry: the preflight reads
    it from the gradient's trace, with no second trace of the forward, and
    2 devices train what one trains."""
    retraced = []
    trace = dpax.analysis.refusals.trace
    monkeypatch.setattr(dpax.analysis.refusals, "trace",
                        lambda *args: retraced.append(1) or trace(*args))
    one, two = train(labels_by_position, 1, 0).params, train(labels_by_position, 2, 0).params
    assert retraced == []
    assert max_diff(one, two) < 1e-6, max_diff(one, two)


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def from_the_first_normed(model, batch):
    z = model(batch["x"])
    return jnp.sum((z - z[0]) ** 2, -1)


def test_what_mixes_after_a_synchronized_batchnorm_is_read():
    """dpax's synchronized BatchNorm adds the rows pairwise (exact sums) before
    its all-reduce: the analysis reads that as a sum over the rows, so what
    mixes after it is still refused."""
    x, y = data(0)
    t = dpax.Trainer(Normed(nnx.Rngs(0)), from_the_first_normed, optax.adam(1e-2), devices=2)
    with pytest.raises(MixesExamples, match="depends on the other examples"):
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)


def test_a_loss_over_the_batch_is_refused_on_several_devices():
    one = train(in_batch, 1, 0, steps=1)  # one device: the loss means what it says
    assert int(one.state.step) == 1
    x, y = data(0)
    t = dpax.Trainer(Towers(nnx.Rngs(0)), in_batch, optax.adam(1e-2), devices=2)
    before = t.params
    with pytest.raises(MixesExamples, match="depends on the other examples") as e:
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert "\n" not in str(e.value) and "test_rows.py" in e.value.where
    assert "global_rows" in str(e.value)
    assert int(t.state.step) == 0  # nothing trained, nothing changed
    jax.tree.map(np.testing.assert_array_equal, before, t.params)


def rolled_negatives(model, batch):
    """Each example's negative is the example before it in the batch
    (`jnp.roll`): on N devices, the one before it on its own device."""
    za, zb = model(batch["x"])
    return jax.nn.softplus(jnp.sum(za * jnp.roll(zb, 1, axis=0), -1) - jnp.sum(za * zb, -1))


def towards_the_hardest(model, batch):
    """Each example pulled towards the batch's hardest one, picked by index."""
    za, zb = model(batch["x"])
    hardest = zb[jnp.argmax(jnp.sum(za * zb, -1))]
    return jnp.sum((za - jax.lax.stop_gradient(hardest)) ** 2, -1)


def mixup(model, batch):
    """Mixup: each example blended with another, by a permutation of the batch."""
    x = batch["x"]
    mixed = 0.7 * x + 0.3 * jax.random.permutation(jax.random.key(0), x)
    za, zb = model(mixed)
    return jnp.sum((za - zb) ** 2, -1)


def from_the_first(model, batch):
    """Each example measured from the batch's first one."""
    za, zb = model(batch["x"])
    return jnp.sum((za - zb[0]) ** 2, -1)


def next_in_the_batch(model, batch):
    """Each example but the first also scored against the one before it."""
    za, zb = model(batch["x"])
    pairs = jax.nn.softplus(jnp.sum(za[1:] * zb[:-1], -1))
    return jnp.sum((za - zb) ** 2, -1).at[1:].add(pairs)


@pytest.mark.parametrize("loss", [rolled_negatives, towards_the_hardest, next_in_the_batch,
                                  mixup, from_the_first])
@pytest.mark.parametrize("seed", [0, 1])
def test_rows_moved_or_picked_by_position_are_refused(loss, seed, monkeypatch):
    """Refused on 2 devices, naming the user's line, before anything changes;
    with the refusal switched off the 2 devices train other params than one."""
    one = train(loss, 1, seed).params
    x, y = data(seed)
    t = dpax.Trainer(Towers(nnx.Rngs(seed)), loss, optax.adam(1e-2), devices=2)
    before = t.params
    with pytest.raises(MixesExamples, match="depends on the other examples") as e:
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert "test_rows.py" in e.value.where, e.value.where
    jax.tree.map(np.testing.assert_array_equal, before, t.params)

    monkeypatch.setattr(dpax.analysis.refusals, "first_mixed", lambda kinds: None)
    diff = max_diff(one, train(loss, 2, seed).params)
    assert diff > 1e-3, diff


def in_halves(model, batch):
    """The towers run on each half of the batch apart, the halves put back
    in order: every example's loss is still its own."""
    x = batch["x"]
    half = x.shape[0] // 2
    (a1, b1), (a2, b2) = model(x[:half]), model(x[half:])
    za, zb = jnp.concatenate([a1, a2]), jnp.concatenate([b1, b2])
    return jnp.sum((za - zb) ** 2, -1)


def row_by_row(model, batch):
    """Each example's loss computed on its own, written into its place."""
    losses = jnp.zeros(batch["x"].shape[0])
    for i in range(batch["x"].shape[0]):
        za, zb = model(batch["x"][i:i + 1])
        losses = losses.at[i].set(jnp.sum((za - zb) ** 2))
    return losses


@pytest.mark.parametrize("loss", [in_halves, row_by_row])
@pytest.mark.parametrize("seed", [0, 1])
def test_rows_computed_in_parts_and_put_back_in_order_train_as_one_device(loss, seed):
    one = train(loss, 1, seed).params
    for n in (2, 4):
        diff = max_diff(one, train(loss, n, seed).params)
        assert diff < 2e-6, (n, diff)


def test_a_loss_with_a_running_max_over_the_batch_is_refused():
    """cummax over the batch's losses: read from the forward's own trace (the
    gradient's writes it as ops the analysis does not read)."""
    def running_max(model, batch):
        za, _ = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(za, batch["y"])
        return losses + jax.lax.cummax(losses, 0)

    x, y = data(0)
    t = dpax.Trainer(Towers(nnx.Rngs(0)), running_max, optax.adam(1e-2), devices=2)
    with pytest.raises(MixesExamples, match="cummax at .*test_rows.py"):
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)


def test_the_refusal_comes_before_an_error_of_the_gradient():
    """A loss that mixes the rows and that JAX cannot differentiate in reverse
    (a while loop): the refusal, which names what to change for N devices,
    is the error the user sees."""
    def looped(model, batch):
        scaled = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] * 1.5, c[1] + 1),
                                    (in_batch(model, batch), 0))[0]
        return scaled

    x, y = data(0)
    t = dpax.Trainer(Towers(nnx.Rngs(0)), looped, optax.adam(1e-2), devices=2)
    with pytest.raises(MixesExamples, match="depends on the other examples"):
        t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_loss_over_the_global_batch_equals_one_device(seed):
    """15 rows: 16 on 4 devices, one padded row each step that `global_rows`
    masks out of every example's negatives."""
    one = train(whole_batch, 1, seed).params
    for n, layout in ((2, "replicated"), (4, "replicated"), (4, "full")):
        params = train(whole_batch, n, seed, sharding=layout).params
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(params)))
        assert diff < 2e-6, (n, layout, diff)


def test_per_device_statistics_asked_for_are_not_refused():
    """`sync_batchnorm=False` asks for each device's batch statistics: a layer
    that centres on the device's rows then trains (not equivalent, as asked)."""

    class Centred(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            h = self.l(x)
            return h - h.mean(0)

    def loss(model, batch):
        return jnp.sum(model(batch["x"]) ** 2, -1)

    x, y = data(0)
    with pytest.raises(MixesExamples, match=r"sub at .*test_rows.py"):
        dpax.Trainer(Centred(nnx.Rngs(0)), loss, optax.sgd(0.1), devices=2).fit(
            x, y, batch_size=15, until_step=1, log_every=10**9)
    t = dpax.Trainer(Centred(nnx.Rngs(0)), loss, optax.sgd(0.1), devices=2,
                     sync_batchnorm=False)
    t.fit(x, y, batch_size=15, until_step=1, log_every=10**9)
    assert int(t.state.step) == 1


def centred_prediction(model, batch):
    za, _ = model(batch["x"])
    return za - za.mean(0)


def test_evaluation_and_prediction_refuse_what_training_refuses():
    """A loss or `predict_fn` that mixes the rows gives other numbers on N
    devices in `evaluate` and `predict` too: refused there, not on one device."""
    x, y = data(0)
    for n in (1, 2):
        t = dpax.Trainer(Towers(nnx.Rngs(0)), rolled_negatives, optax.adam(1e-2), devices=n,
                         predict_fn=centred_prediction)
        if n == 1:
            assert np.isfinite(t.evaluate(x, y, batch_size=15)["loss"])
            assert t.predict(x, batch_size=15).shape == (45, 16)
            continue
        with pytest.raises(MixesExamples, match="concatenate at .*test_rows.py"):
            t.evaluate(x, y, batch_size=15)
        with pytest.raises(MixesExamples, match="sub at .*test_rows.py"):
            t.predict(x, batch_size=15)


def test_evaluation_in_parts_equals_one_device():
    """Runs of the rows put back in order are not refused in evaluation
    either (a guard against a false refusal: before, nothing was read)."""
    x, y = data(0)
    one = dpax.Trainer(Towers(nnx.Rngs(0)), in_halves, optax.sgd(0.1), devices=1).evaluate(
        x, y, batch_size=15)
    for n in (2, 4):
        got = dpax.Trainer(Towers(nnx.Rngs(0)), in_halves, optax.sgd(0.1),
                           devices=n).evaluate(x, y, batch_size=15)
        assert abs(got["loss"] - one["loss"]) < 1e-6 * abs(one["loss"]), (n, got, one)
