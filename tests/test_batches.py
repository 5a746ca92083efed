"""Batches of any structure: a dict of arrays that share a leading example
axis reaches the loss whole (every key, plus `mask`), padded, masked and
ordered like `x`/`y`; the reference is one device with the same batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import max_diff
from dpax.data.pipeline import BatchPlan
from dpax.errors import DpaxError

SEQ, VOCAB, WIDTH = 12, 17, 16
BATCH = 29  # uneven for 3 and 8 devices


class TinyTransformer(nnx.Module):
    """One attention block over token ids, attending within a segment and
    only to the tokens the data marks as real."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, WIDTH)))
        # No biases: softmax ignores the key's, so its exact gradient is 0 and
        # Adam turns the rounding noise in it into lr-sized steps (1.7e-3 apart
        # on 1 vs 3 devices, every other param within 1e-7).
        self.attn = nnx.MultiHeadAttention(2, WIDTH, decode=False, use_bias=False, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens, segment_ids, real):
        h = self.embed(tokens) + self.pos[...]
        same = nnx.make_attention_mask(segment_ids, segment_ids, jnp.equal, dtype=bool)
        mask = (same & nnx.make_attention_mask(real, real, dtype=bool)
                & nnx.make_causal_mask(tokens, dtype=bool))
        return self.out(self.norm(h + self.attn(h, mask=mask)))


def token_loss(model, batch):
    """Next-token loss over the tokens the data marks real, one value per
    sequence, weighted by the sequence's `weight` from the data."""
    logits = model(batch["tokens"], batch["segment_ids"], batch["mask_from_data"])
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    real = batch["mask_from_data"].astype(jnp.float32)
    loss = jnp.sum(per_token * real, -1) / jnp.maximum(jnp.sum(real, -1), 1.0)
    return loss, {"tokens": jnp.sum(real, -1)}, batch["weight"]


def predict(model, batch):
    logits = model(batch["tokens"], batch["segment_ids"], batch["mask_from_data"])
    return {"next": jnp.argmax(logits, -1), "score": jnp.max(logits, -1).mean(-1)}


def examples(n=200, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    lengths = rng.integers(3, SEQ + 1, n)
    return {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "segment_ids": (np.arange(SEQ)[None, :] >= rng.integers(2, SEQ, n)[:, None]
                        ).astype(np.int32),
        "mask_from_data": np.arange(SEQ)[None, :] < lengths[:, None],
        "weight": rng.uniform(0.5, 2.0, n).astype(np.float32),
    }


def trained(n, data, steps=8, seed=0, **kw):
    t = dpax.Trainer(TinyTransformer(nnx.Rngs(seed)), token_loss, optax.adam(1e-2), devices=n,
                     predict_fn=predict, **kw)
    rows = t.fit(data, batch_size=BATCH, until_step=steps, seed=seed, log_every=1)
    return t, rows


@pytest.fixture(scope="module")
def reference():
    return trained(1, examples())


_ON = {}


def trained_on(n):
    """`trained(n, examples())`, once per module for the tests that read it."""
    if n not in _ON:
        _ON[n] = trained(n, examples())
    return _ON[n]


@pytest.mark.parametrize("n", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_a_model_with_two_inputs_and_a_data_mask_trains_as_on_one_device(n, reference):
    one, rows1 = reference
    t, rows = trained_on(n)
    diff = max_diff(jax.tree.leaves(t.params), jax.tree.leaves(one.params))
    print(f"tiny transformer, 1 vs {n} devices: {diff:.1e}")
    assert diff <= 1e-5
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in rows1], rel=1e-5)
    assert max_diff(jax.tree.leaves(t.params),
                    jax.tree.leaves(nnx.state(TinyTransformer(nnx.Rngs(0)), nnx.Param))) > 1e-3


def test_the_loss_sees_every_key_and_the_weights_come_from_the_data(reference):
    _, rows = reference
    data = examples()
    first = BatchPlan(200, BATCH, seed=0).indices(0)
    assert rows[0]["weight"] == pytest.approx(float(data["weight"][first].sum()), rel=1e-6)
    w, tokens = data["weight"][first], data["mask_from_data"][first].sum(-1)
    assert rows[0]["tokens"] == pytest.approx(float((w * tokens).sum() / w.sum()), rel=1e-6)


def test_predict_returns_one_output_per_example_whatever_its_structure(reference):
    one, _ = reference
    data = examples(n=37, seed=5)
    t, _ = trained_on(3)
    got, want = t.predict(data, batch_size=16), one.predict(data, batch_size=11)
    assert set(got) == {"next", "score"} and got["next"].shape == (37, SEQ)
    np.testing.assert_array_equal(got["next"], want["next"])
    np.testing.assert_allclose(got["score"], want["score"], rtol=1e-5)
    host = one.model()
    host.eval()
    direct = predict(host, jax.tree.map(jnp.asarray, data))
    np.testing.assert_allclose(want["score"], direct["score"], rtol=1e-5)
    assert one.evaluate(data)["loss"] == pytest.approx(t.evaluate(data)["loss"], rel=1e-5)


@pytest.mark.slow
def test_fit_stream_takes_dict_batches_of_any_size():
    data = examples()
    sizes = [5, 29, 13, 1, 40]
    starts = np.cumsum([0] + sizes)

    def batches():
        for a, b in zip(starts, starts[1:]):
            yield jax.tree.map(lambda v, a=a, b=b: v[a:b], data)

    runs = []
    for n in (1, 8):
        t = dpax.Trainer(TinyTransformer(nnx.Rngs(0)), token_loss, optax.sgd(0.1), devices=n)
        # Two buckets: two compiles each (test_trainer.py checks the default buckets).
        t.fit_stream(batches(), buckets=[8, 40])
        runs.append(jax.tree.leaves(t.params))
    assert max_diff(*runs) <= 1e-5


def test_streamed_columns_train_as_the_same_arrays_in_memory(tmp_path, reference):
    """The same examples in Parquet files, each column read per batch from
    disk (row groups of 32), train the params of the in-memory run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = examples()
    for part in range(2):
        rows = slice(part * 100, (part + 1) * 100)
        pq.write_table(pa.table({
            k: pa.array(list(v[rows])) if v.ndim > 1 else pa.array(v[rows])
            for k, v in data.items()}), tmp_path / f"part-{part}.parquet", row_group_size=32)
    columns = dpax.data.sources.open_columns(str(tmp_path), list(data))
    assert all(columns[k].dtype == data[k].dtype for k in data)
    one, _ = reference
    t, _ = trained(8, columns)
    assert max_diff(jax.tree.leaves(t.params), jax.tree.leaves(one.params)) <= 1e-5


@pytest.mark.parametrize("bad,message", [
    ({"x": np.ones((4, 2)), "mask": np.ones(4, bool)}, "rename yours, e.g. 'attention_mask'"),
    ({"x": np.ones((4, 2)), "index": np.arange(4)}, "rename yours, e.g. 'position'"),
    ({"x": np.ones((4, 2)), "y": np.ones(3)}, "differ in length"),
    ({}, "empty dict")])
def test_bad_examples_are_one_line_errors(bad, message):
    t = dpax.Trainer(TinyTransformer(nnx.Rngs(0)), token_loss, optax.sgd(0.1), devices=2)
    with pytest.raises(DpaxError, match=message):
        t.fit(bad, batch_size=4, until_step=1)
