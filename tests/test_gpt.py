"""A GPT on text: N devices give one device's params (SGD) and loss curve
(Adam), with padded short documents, an uneven batch, dropout, remat and an
EMA; the loss is the mean over tokens, not over windows; sampling follows the
model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import forward, max_diff
from dpax import models
from dpax.cli import main
from dpax.data import text, tokenizer
from dpax.models import losses
from dpax.models.generate import generate

SEQ = 16
BATCH = 13  # uneven on 2, 4 and 8 devices: every N pads
STEPS = 8
# One block: what these tests prove holds block by block, and XLA's compile
# time (most of theirs) grows with the blocks; the key/value cache's test
# keeps two, where a layer could read another's cache.
GPT = {"layers": 1, "width": 32, "heads": 2}


def write_corpus(root, n_docs=40, seed=0):
    """Documents of 1..80 bytes of word-like text: many shorter than a window."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "x", "import", "for", "in", "(", ")", ":", "\n", "    "]
    root.mkdir(exist_ok=True)
    for i in range(n_docs):
        doc = " ".join(rng.choice(words, size=rng.integers(1, 25)))[: rng.integers(1, 81)]
        (root / f"doc{i:02d}.py").write_text(doc)
    return str(root)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return dpax.data.load("text:" + write_corpus(tmp_path_factory.mktemp("corpus")), SEQ)


def gpt(ds, **options):
    return models.make_model("gpt", ds.input_shape, ds.n_out, 0, "lm", **{**GPT, **options})


def fit(ds, n, tx, **kw):
    opts = {k: kw.pop(k) for k in ("remat", "dropout") if k in kw}
    t = dpax.Trainer(gpt(ds, **opts), losses.lm_loss, tx, devices=n, **kw)
    rows = t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=STEPS, log_every=1)
    return t, rows


@pytest.fixture(scope="module")
def sgd_reference(corpus):
    return fit(corpus, 1, optax.sgd(0.5), dropout=0.1, ema_decay=0.9)


def test_text_windows_cover_every_token_once_and_pad_short_documents(tmp_path):
    docs = [b"a", b"ab", b"hello world", bytes(range(40))]
    xs, ys = text.stack(docs, 8, tokenizer.byte_tokens())
    # Every token but a document's first is a target exactly once.
    targets = sum(int(n) - 1 for n in ys)
    assert targets == sum(len(d) - 1 for d in docs)
    assert ys.min() >= 2 and ys.max() <= 9
    x, n = text.windows(np.frombuffer(b"hello world", np.uint8), 8)
    assert bytes(x[0]) == b"hello wor" and bytes(x[1][:n[1]]) == b"rld"
    assert not x[1][n[1]:].any()  # padded with zeros, masked by the length
    root = write_corpus(tmp_path / "c", n_docs=60)
    names = [name for name, _ in text.documents(root, SEQ)]
    train, held = text.split(text.documents(root, SEQ))
    assert len(held) == round(60 * text.EVAL_FRACTION) or len(held) == 1
    assert len(train) + len(held) == len(names)


def test_token_weighted_loss_is_the_mean_over_tokens_not_windows(corpus, sgd_reference):
    """The trained reference's state on 4 devices, 37 windows of which many are
    short: dpax's eval loss is the closed-form mean over real tokens."""
    t = dpax.Trainer(gpt(corpus, dropout=0.1), losses.lm_loss, optax.sgd(0.5), devices=4,
                     ema_decay=0.9)
    t.load_state_dict(sgd_reference[0].state_dict())
    x, y = corpus.x_train[-37:], corpus.y_train[-37:]
    ev = t.evaluate(x, y, batch_size=16)
    model = t.model()
    model.eval()
    logits = np.asarray(forward(model, x[:, :-1]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    print(f"{(y < SEQ + 1).sum()} of {len(y)} windows short")
    tgt = x[:, 1:].astype(int)
    nll = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    real = np.arange(SEQ)[None] < (y[:, None] - 1)
    per_token = nll[real].mean()
    per_window = np.mean([nll[i][real[i]].mean() for i in range(len(x))])
    assert ev["weight"] == real.sum() and ev["examples"] == len(x)
    assert abs(ev["loss"] - per_token) < 1e-5
    assert abs(per_token - per_window) > 1e-3  # the two means differ on this data


@pytest.mark.parametrize("n,remat", [
    pytest.param(2, "none", marks=pytest.mark.slow),
    pytest.param(4, "block", marks=pytest.mark.equivalence),
    pytest.param(8, "dots", marks=pytest.mark.slow)])
def test_gpt_sgd_params_and_ema_equal_one_device(corpus, sgd_reference, n, remat):
    ref, ref_rows = sgd_reference
    t, rows = fit(corpus, n, optax.sgd(0.5), dropout=0.1, ema_decay=0.9, remat=remat)
    params, ema = max_diff(t.params, ref.params), max_diff(t.ema_params, ref.ema_params)
    moved = max_diff(ref.params, nnx.state(gpt(corpus), nnx.Param))
    print(f"N={n} remat={remat}: params {params:.2e}, ema {ema:.2e} (moved {moved:.2e})")
    assert params <= 1e-5 and ema <= 1e-5 and moved > 1e-2
    assert [r["weight"] for r in rows] == [r["weight"] for r in ref_rows]


# Adam with an EMA, fully sharded on 8 devices: the EMA test below resumes
# this run, so the two tests compile its step once.
FULL = {"sharding": "full", "ema_decay": 0.8}


@pytest.fixture(scope="module")
def adam_full_on_8(corpus):
    return fit(corpus, 8, optax.adam(3e-3), **FULL)


def test_gpt_adam_loss_curve_equals_one_device_fully_sharded(corpus, adam_full_on_8):
    _, one = fit(corpus, 1, optax.adam(3e-3))
    _, eight = adam_full_on_8  # its EMA leaves the training loss alone
    rel = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(eight, one))
    print(f"Adam, full on 8 vs 1: loss curve rel {rel:.2e}")
    assert rel <= 1e-4 and one[-1]["loss"] < one[0]["loss"]


def test_ema_is_used_for_eval_and_resumes_bit_identically(corpus, adam_full_on_8):
    x, y = corpus.x_eval, corpus.y_eval
    whole, _ = adam_full_on_8
    half = dpax.Trainer(gpt(corpus), losses.lm_loss, optax.adam(3e-3), devices=8, **FULL)
    half.fit(corpus.x_train, corpus.y_train, batch_size=BATCH, until_step=STEPS // 2)
    resumed = dpax.Trainer(gpt(corpus), losses.lm_loss, optax.adam(3e-3), devices=8, **FULL)
    resumed.load_state_dict(half.state_dict())
    resumed.fit(corpus.x_train, corpus.y_train, batch_size=BATCH, until_step=STEPS)
    a, b = whole.evaluate(x, y), resumed.evaluate(x, y)
    assert a["loss"] == b["loss"]  # bit-identical
    raw = dpax.Trainer(gpt(corpus), losses.lm_loss, optax.adam(3e-3), devices=8,
                       sharding="full")
    raw.load_state_dict({k: v for k, v in whole.state_dict().items()
                         if not k.startswith("ema")})
    assert abs(raw.evaluate(x, y)["loss"] - a["loss"]) > 1e-4  # eval did use the EMA


SAMPLED = {"temperature": 0.9, "top_k": 5, "top_p": 0.8}


def test_greedy_sampling_follows_the_model(corpus):
    model = gpt(corpus)
    prompt = b"def x(self):\n    return"  # longer than SEQ: the context window slides
    out = generate(model, prompt, 8, SEQ, temperature=0.0)
    last = nnx.jit(lambda m, ctx: m(ctx)[0, -1])
    seq = list(prompt)
    for _ in range(8):  # the reference: the model on the last SEQ tokens, one at a time
        seq.append(int(np.argmax(np.asarray(last(model, np.array(seq[-SEQ:], np.int32)[None])))))
    assert out.tolist() == seq[len(prompt):]
    # Sampled as in the cache test below: the two share the compiled loop.
    assert len(generate(model, prompt, 6, SEQ, seed=3, **SAMPLED)) == 6


def cached_logits(model, ids, prompt: int):
    """Every position's logits from the cache: the first `prompt` tokens in
    one call, then one token per (compiled) call."""
    step = nnx.jit(lambda m, token, cache, p: m.cached(token, cache, p))
    first = nnx.jit(lambda m, ids: m.cached(ids, m.empty_cache(1), 0))  # as `forward` does
    logits, cache = first(model, ids[:, :prompt])
    parts = [logits]
    for p in range(prompt, ids.shape[1]):
        logits, cache = step(model, ids[:, p:p + 1], cache, jnp.int32(p))
        parts.append(logits)
    return jnp.concatenate(parts, 1)


@pytest.mark.parametrize("seed", [0, *[pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)]])
def test_the_key_value_cache_gives_the_whole_windows_logits(seed):
    """The prompt in one call, then one token per call from the cache: the
    logits of every position as the whole window computes them."""
    model = models.gpt.GPT(256, SEQ, layers=2, width=32, heads=4, rngs=nnx.Rngs(seed))
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, 256, (1, SEQ)))
    diff = float(jnp.max(jnp.abs(cached_logits(model, ids, 5) - forward(model, ids))))
    print(f"seed {seed}: cached vs whole-window logits, max |diff| {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("prompt,n,how", [
    # Greedy: test_llama.py's cache test draws greedily through the same loop.
    pytest.param(b"def", 30, {"temperature": 0.0}, marks=pytest.mark.slow, id="greedy"),
    pytest.param(b"def", 30, SAMPLED, id="sampled"),
    pytest.param(b"def x(self):\n    return", 6, SAMPLED, id="sampled-past-the-context")])
def test_sampling_with_the_cache_draws_what_the_window_draws(corpus, prompt, n, how):
    """Greedy and sampled (temperature, top-k, top-p) tokens, within the
    context and past it (where the window slides and the cache stops)."""
    model = gpt(corpus)
    with_cache, without = (generate(model, prompt, n, SEQ, seed=3, cache=c, **how)
                           for c in (True, False))
    assert with_cache.tolist() == without.tolist(), (prompt, how)


@pytest.mark.parametrize("kw,says", [({"top_k": 0}, "`top_k` must be >= 1"),
                                     ({"top_p": 0.0}, r"`top_p` must be in \(0, 1\]"),
                                     ({"top_p": 1.5}, r"`top_p` must be in \(0, 1\]")])
def test_a_sampling_limit_no_draw_can_use_is_refused(kw, says):
    from dpax.models.generate import check

    with pytest.raises(dpax.DpaxError, match=says):
        check(b"def", 5, 0.8, **kw)


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    from dpax.models.generate import Picker

    logits = jnp.log(jnp.array([0.05, 0.5, 0.3, 0.15]))
    keys = jax.random.split(jax.random.key(0), 400)
    drawn = {k: set(np.asarray(jax.vmap(lambda key, p=p: p(logits, key))(keys)).tolist())
             for k, p in {"k2": Picker(1.0, top_k=2), "p0.7": Picker(1.0, top_p=0.7),
                          "p0.5": Picker(1.0, top_p=0.5), "all": Picker(1.0)}.items()}
    # top-p keeps the likeliest tokens until their sum reaches p, the crossing one included.
    assert drawn == {"k2": {1, 2}, "p0.7": {1, 2}, "p0.5": {1}, "all": {0, 1, 2, 3}}


@pytest.mark.slow
def test_remat_policies_cut_the_steps_memory_in_xlas_analysis():
    """At a length where activations dominate, XLA's memory analysis of the
    training step itself: what it needs besides its arguments, per policy
    (on XLA:CPU with the tuning's `dpax.xla_cpu.backward`, without which
    remat saves nothing there: jax-ml/jax#19822)."""
    x = np.zeros((8, 257), np.uint8)
    host = {"x": x, "y": np.full(8, 257, np.int32), "mask": np.ones(8, bool)}
    temp = {}
    for remat in ("none", "block", "dots"):
        model = models.make_model("gpt", (257,), 256, 0, "lm", layers=3, width=32, heads=2,
                                  remat=remat)
        # SGD: the temporaries are the activations, the same with Adam (measured:
        # 59.4, 20.4, 25.2 MiB with either), and its step compiles faster.
        t = dpax.Trainer(model, losses.lm_loss, optax.sgd(1e-3), devices=1, xla_cpu_tuning=True)
        temp[remat] = t.lower_train_step(host, 8).compile().memory_analysis().temp_size_in_bytes
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()})
    assert temp["block"] <= 0.5 * temp["none"]
    assert temp["block"] < temp["dots"] < temp["none"]


def test_flops_per_token_counts_six_per_weight_plus_attention():
    ds_shape, vocab = (65,), 256
    model = models.make_model("gpt", ds_shape, vocab, 0, "lm", layers=2, width=32, heads=2)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) - 64 * 32
    from dpax.models.gpt import flops_per_token

    assert flops_per_token(n, 2, 32, 64) == 6 * n + 12 * 2 * 32 * 64
    assert math.isclose(n, 256 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32)


def test_the_model_config_knows_its_flops_per_token():
    """The MFU's numerator comes from the model's own config, not the CLI."""
    from dpax.models.gpt import flops_per_token
    from dpax.models.registry import ModelConfig

    model = models.make_model("gpt", (65,), 256, 0, "lm", layers=2, width=32, heads=2)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    config = ModelConfig("gpt", layers=2, width=32, heads=2)
    assert config.flops_per_token(count, 64) == flops_per_token(count - 64 * 32, 2, 32, 64)
    assert ModelConfig("cnn").flops_per_token(count, 64) is None


def test_attention_on_cpu_is_xlas_and_equals_the_previous_call_and_the_textbook_one(
        corpus, monkeypatch):
    """The GPT's logits with the platform's attention equal those of the call it
    made before (`jax.nn.dot_product_attention(q, k, v, is_causal=True)`), bit
    for bit on CPU, and softmax(q k^T / sqrt(d) + causal mask) v to rounding."""
    from dpax.models import gpt as gpt_module

    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 17, 4, 8))
    mine = gpt_module.causal_attention(q, k, v)
    np.testing.assert_array_equal(mine, jax.nn.dot_product_attention(q, k, v, is_causal=True))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    scores = jnp.where(np.tril(np.ones((17, 17), bool)), scores, -np.inf)
    textbook = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    np.testing.assert_allclose(mine, textbook, atol=1e-6)

    model = gpt(corpus)
    tokens = corpus.x_train[:5, :-1]  # a window's inputs: all but its last token
    logits = forward(model, tokens)
    assert np.isfinite(logits).all()
    monkeypatch.setattr(gpt_module, "causal_attention",
                        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    np.testing.assert_array_equal(logits, forward(model, tokens))


@pytest.mark.parametrize("dtype,head,capability,takes", [
    ("bfloat16", 64, 9.0, True),
    ("float16", 128, 8.0, True),
    ("float32", 64, 9.0, False),  # cuDNN's kernel takes half precision
    ("bfloat16", 12, 9.0, False),  # not a multiple of 8
    ("bfloat16", 256, 9.0, False),  # over dpax's cap
    ("bfloat16", 64, 7.5, False),  # before Ampere
    ("bfloat16", 64, None, False),  # no NVIDIA GPU (CPU, TPU, ROCm)
])
def test_cudnn_attention_is_chosen_only_where_it_takes_the_inputs(dtype, head, capability,
                                                                  takes):
    from dpax.models.gpt import cudnn_takes

    assert cudnn_takes(np.dtype(getattr(jnp, dtype)), head, capability) is takes


@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_packed_windows_give_each_token_its_unpacked_loss_and_gradient(tmp_path, name):
    """The same documents in windows of their own and packed together: every
    real target's loss (as a multiset) and the gradient of their sum agree,
    though the packed data holds fewer windows and less padding."""
    root = write_corpus(tmp_path / "corpus", n_docs=30, seed=1)
    plain, packed = (dpax.data.load("text:" + root, SEQ, packed=p) for p in (False, True))
    assert len(packed.x_train) < len(plain.x_train)
    model = models.make_model(name, plain.input_shape, plain.n_out, 0, "lm",
                              **{**GPT, "heads": 4} if name == "llama" else GPT)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def token_losses(params, x, y):
        m = nnx.merge(graphdef, params, rest)
        logits = m(x[:, :-1], y[:, :-1]) if y.ndim == 2 else m(x[:, :-1])
        per = optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:].astype(jnp.int32))
        real = ((y[:, 1:] == y[:, :-1]) & (y[:, 1:] > 0) if y.ndim == 2
                else jnp.arange(SEQ) < y[:, None] - 1)
        return jnp.sum(jnp.where(real, per, 0.0)), (per, real)

    @jax.jit
    def measure(params, x, y):
        """One compiled program per data set: each token's loss, the gradient
        of their sum, and the loss dpax trains on (the mean over tokens)."""
        (_, (per, real)), grad = jax.value_and_grad(token_losses, has_aux=True)(params, x, y)
        per_window, _, tokens = losses.lm_loss(nnx.merge(graphdef, params, rest),
                                               {"x": x, "y": y})
        return per, real, grad, jnp.sum(per_window * tokens) / jnp.sum(tokens)

    (per, real, grad, mean), (pper, preal, pgrad, pmean) = (
        measure(params, ds.x_train, ds.y_train) for ds in (plain, packed))
    sorted_losses = [np.sort(np.asarray(p)[np.asarray(r)]) for p, r in ((per, real),
                                                                        (pper, preal))]
    assert len(sorted_losses[0]) == len(sorted_losses[1])
    loss_diff = float(np.max(np.abs(sorted_losses[0] - sorted_losses[1])))
    # Relative to the gradient's largest element: a sum over every token.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad))
    grad_diff = max_diff(grad, pgrad) / scale
    print(f"{name}: {len(plain.x_train)} windows -> {len(packed.x_train)} packed; per-token "
          f"loss max |diff| {loss_diff:.1e}, gradient of the sum {grad_diff:.1e} of its "
          f"largest element")
    assert loss_diff <= 1e-5 and grad_diff <= 1e-5
    # The loss dpax trains on: the same mean over tokens.
    assert abs(float(mean) - float(pmean)) <= 1e-5


def test_packed_text_trains_on_n_devices_as_on_one(tmp_path):
    root = write_corpus(tmp_path / "corpus", n_docs=30, seed=2)
    ds = dpax.data.load("text:" + root, SEQ, packed=True)
    runs = []
    for n in (1, 4):
        # SGD: Adam's first steps divide near-zero gradients by their own size,
        # which turns any rounding into lr-sized moves, packed or not.
        t = dpax.Trainer(gpt(ds, dropout=0.1), losses.lm_loss, optax.sgd(0.5), devices=n)
        t.fit(ds.x_train, ds.y_train, batch_size=BATCH, until_step=4)
        runs.append(jax.tree.leaves(t.params))
    diff = max_diff(*runs)
    print(f"packed text, 4 devices vs 1: max |params diff| {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_a_packed_run_resumes_exactly(tmp_path, capsys):
    root = write_corpus(tmp_path / "corpus", n_docs=40, seed=3)
    flags = ["--model", "llama", "--layers", "2", "--width", "32", "--heads", "4",
             "--data", f"text:{root}", "--seq-len", str(SEQ), "--pack", "--batch-size", "6",
             "--steps", "12", "--devices", "2", "--log-every", "4"]
    ck = str(tmp_path / "ck")
    assert main(["train", *flags, "--out", str(tmp_path / "ref")]) == 0
    assert main(["train", *flags, "--checkpoint-dir", ck, "--checkpoint-every", "4",
                 "--out", str(tmp_path / "a")]) == 0
    import shutil

    shutil.rmtree(f"{ck}/12")
    shutil.rmtree(f"{ck}/8")
    assert main(["train", *flags, "--resume", f"{ck}/4", "--out", str(tmp_path / "b")]) == 0
    assert "resumed at step 4" in capsys.readouterr().out
    with np.load(tmp_path / "ref" / "params.npz") as a, np.load(tmp_path / "b" /
                                                                  "params.npz") as b:
        assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files) == 0.0


def test_pack_keeps_full_windows_and_fills_shared_ones_in_order():
    x = np.arange(1, 26).reshape(5, 5)
    packed, segments = text.pack(x, np.array([5, 2, 2, 3, 1]))
    assert segments.tolist() == [[1, 1, 1, 1, 1], [1, 1, 2, 2, 0], [1, 1, 1, 2, 0]]
    assert packed.tolist() == [[1, 2, 3, 4, 5], [6, 7, 11, 12, 0], [16, 17, 18, 21, 0]]
    with pytest.raises(dpax.DpaxError, match="`pack` packs text documents"):
        dpax.config.validate(dpax.cli.train.TrainConfig.from_flags(data="digits", pack=True))


def test_windows_longer_than_the_gpts_positions_are_refused_before_training():
    """A window one token longer than `make_model`'s trained to NaN params in
    silence: the position past the table read NaN (a reviewer's)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (24, 17)).astype(np.int32)
    t = dpax.Trainer(dpax.make_model("gpt", (16,), 64, 0), dpax.lm_loss, optax.sgd(0.5),
                     devices=2)
    with pytest.raises(dpax.errors.BadExamples, match=r"reads at most 15 tokens a window"):
        t.fit(x, np.full(24, 17, np.int32), batch_size=12, until_step=2, log_every=10**9)
    assert t.step == 0
    t.fit(x[:, :16], np.full(24, 16, np.int32), batch_size=12, until_step=2, log_every=10**9)
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(t.params))
