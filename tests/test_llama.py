"""The Llama-family model (`dpax.models.llama`): the same logits as
`transformers`' `LlamaForCausalLM` both ways (sharded safetensors and the
directory's own BPE included), N devices train what one device trains, its
key/value cache gives the whole window's logits, and bad imports are one
line. The comparisons with `transformers` are marked `interop` (torch and
transformers come with `pip install -e '.[interop]'`, `make test-interop`);
the refusals read a directory dpax writes itself."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import forward, max_diff
from dpax import config as cfg
from dpax.cli import main
from dpax.cli.job import build, load_checkpoint
from dpax.cli.train import TrainConfig
from dpax.data import tokenizer
from dpax.models import hf_llama, losses
from dpax.models.llama import Llama
from test_gpt import write_corpus

SEQ = 16
TOLERANCE = 1e-4  # float32 logits, two frameworks' kernels
FLAGS = {"model": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": SEQ}


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, corpus):
    """A Llama as `save_pretrained` writes it, in two safetensors shards,
    every weight random (the norms too, so that a swapped or transposed one
    shows), with grouped-query attention, RoPE base and norm epsilon other
    than dpax's defaults, more positions than the runs use, and a BPE of its
    own trained on the corpus."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _bpe(corpus)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.vocab, hidden_size=32, intermediate_size=80,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, rope_theta=500000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="40KB")
    for name, text in tokenizer.hf_files(tok).items():
        (path / name).write_text(text)
    return str(path), model, tok.vocab


def _bpe(corpus):
    import pathlib

    return tokenizer.train("bpe:300", [p.read_bytes()
                                       for p in sorted(pathlib.Path(corpus).glob("*.py"))])


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, corpus):
    """`llama_dir`'s shape and tokenizer, written by dpax (`hf_llama.save`):
    what the refusals read, without torch."""
    tok = _bpe(corpus)
    path = tmp_path_factory.mktemp("saved")
    model = Llama(tok.vocab, 32, layers=2, width=32, heads=4, kv_heads=2, mlp_width=80,
                  rope_theta=500000.0, norm_eps=1e-6, rngs=nnx.Rngs(0))
    hf_llama.save(model, str(path))
    for name, text in tokenizer.hf_files(tok).items():
        (path / name).write_text(text)
    return str(path), tok.vocab, model


def test_a_sharded_directory_dpax_writes_loads_with_the_same_logits(saved_dir, corpus,
                                                                    tmp_path):
    """The import's own round trip, without torch, from two safetensors
    shards and their index as `save_pretrained` splits a model: the
    directory's own BPE, and the options not given read from it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path, vocab, source = saved_dir
    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded)
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, sharded / file)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    config = cfg.validate(TrainConfig.from_flags(data=f"text:{corpus}", init_from=str(sharded),
                                                 tokenizer=f"bpe:{vocab}", **FLAGS))
    job = build(config)
    assert (config.model.kv_heads, config.model.mlp_width) == (2, 80)
    assert job.ds.tokenizer.vocab == vocab
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (4, SEQ)))
    assert float(jnp.max(jnp.abs(forward(job.trainer.model(), tokens)
                                 - forward(source, tokens)))) == 0.0


@pytest.mark.interop
def test_hugging_faces_llama_loads_with_the_same_logits(llama_dir, corpus):
    path, hf, vocab = llama_dir
    assert json.loads(open(f"{path}/model.safetensors.index.json").read())["weight_map"]
    config = cfg.validate(TrainConfig.from_flags(data=f"text:{corpus}", init_from=path,
                                                 tokenizer=f"bpe:{vocab}", **FLAGS))
    job = build(config)
    # The options not given are the directory's.
    m = config.model
    assert (m.kv_heads, m.mlp_width, m.rope_theta, m.norm_eps, m.tie_embeddings) == (
        2, 80, 500000.0, 1e-6, False)
    assert job.ds.tokenizer.vocab == vocab  # the directory's own BPE
    tokens = np.random.default_rng(0).integers(0, vocab, (4, SEQ))
    diff = float(np.max(np.abs(np.asarray(forward(job.trainer.model(), jnp.asarray(tokens)))
                               - hf_logits(hf, tokens))))
    print(f"Hugging Face Llama -> dpax: max |logit diff| {diff:.1e}")
    assert diff <= TOLERANCE


@pytest.mark.slow
@pytest.mark.interop
@pytest.mark.parametrize("tied", [False, True])
def test_a_dpax_llama_exports_to_what_transformers_loads(tmp_path, corpus, tied):
    flags = ["--model", "llama", "--layers", "2", "--width", "32", "--heads", "4",
             "--kv-heads", "2", "--seq-len", str(SEQ), "--data", f"text:{corpus}",
             "--tokenizer", "bpe:280", "--steps", "3", "--batch-size", "8",
             "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "run"),
             *(["--tie-embeddings"] if tied else [])]
    assert main(["train", *flags]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out",
                 str(tmp_path / "hf")]) == 0
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.tie_word_embeddings == tied and hf.config.num_key_value_heads == 2
    ours = load_checkpoint(str(tmp_path / "ck"), devices=1)
    vocab = ours.tokenizer.vocab
    tokens = np.random.default_rng(1).integers(0, vocab, (3, SEQ))
    diff = float(np.max(np.abs(np.asarray(ours.trainer.model()(jnp.asarray(tokens)))
                               - hf_logits(hf, tokens))))
    print(f"dpax -> Hugging Face Llama (tied {tied}): max |logit diff| {diff:.1e}")
    assert diff <= TOLERANCE
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.encode("def x") == ours.tokenizer.encode(b"def x").tolist()


def small_llama(ds, seed=0, layers=2, **kw):
    return Llama(ds.n_out, SEQ, layers=layers, width=32, heads=4, kv_heads=2,
                 rngs=nnx.Rngs(seed), **kw)


@pytest.fixture(scope="module")
def text():
    import pathlib
    import tempfile

    return dpax.data.load("text:" + write_corpus(pathlib.Path(tempfile.mkdtemp())), SEQ)


@pytest.mark.parametrize("n,sharding,seed", [
    (4, "full", 0), pytest.param(8, "replicated", 1, marks=pytest.mark.slow),
    pytest.param(8, "full", 2, marks=pytest.mark.slow),
    pytest.param(4, "replicated", 0, marks=pytest.mark.slow)])
def test_n_devices_train_the_llama_one_device_trains(text, n, sharding, seed):
    """Adam, an uneven batch of 13 windows, dropout (per-example masks); one
    block (each block trains alike, and each compiles)."""
    runs = []
    for devices, kw in ((1, {}), (n, {"sharding": sharding})):
        t = dpax.Trainer(small_llama(text, seed, layers=1, dropout=0.1), losses.lm_loss,
                         optax.adam(3e-3), devices=devices, **kw)
        t.fit(text.x_train, text.y_train, batch_size=13, until_step=6)
        runs.append(jax.tree.leaves(t.params))
    diff = max_diff(*runs)
    print(f"llama {sharding} N={n} seed {seed}: max |params diff| {diff:.1e}")
    assert diff <= 1e-5


def test_the_cache_gives_the_whole_windows_logits_with_grouped_queries(text):
    from test_gpt import cached_logits

    model = small_llama(text, tie_embeddings=True)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, text.n_out, (1, SEQ)))
    assert float(jnp.max(jnp.abs(cached_logits(model, ids, 4) - forward(model, ids)))) <= 1e-5
    out = [dpax.models.generate.generate(model, b"def", 20, SEQ, temperature=0.0, cache=c)
           for c in (True, False)]
    assert out[0].tolist() == out[1].tolist()


def _rewrite(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads(open(f"{dst}/config.json").read())
    config.update(changes)
    open(f"{dst}/config.json", "w").write(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("change,flags,says", [
    ({}, {"kv_heads": 4}, "holds a Llama with --kv-heads 2, not 4"),
    ({}, {"width": 64}, "holds a Llama with --width 32, not 64"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}, {},
     "rope_scaling .* dpax's llama cannot compute it exactly"),
    ({"model_type": "mistral"}, {}, "describes a 'mistral' model; dpax's llama imports Llama"),
    ({"hidden_act": "gelu"}, {}, "activation 'gelu'")])
def test_bad_imports_are_one_line_errors(saved_dir, corpus, tmp_path, capsys, change, flags,
                                         says):
    import re

    path = _rewrite(saved_dir[0], tmp_path / "dir", **change)
    args = {**FLAGS, **flags}
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    assert main(["train", *argv, "--data", f"text:{corpus}", "--init-from", path,
                 "--tokenizer", f"bpe:{saved_dir[1]}", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(says, err[0]), err


def test_llama_options_belong_to_llama():
    with pytest.raises(dpax.DpaxError, match="`kv_heads` is an option of `model=llama`"):
        cfg.validate(TrainConfig.from_flags(model="gpt", data="text", kv_heads=2))
    with pytest.raises(dpax.DpaxError, match="must divide `heads` 4"):
        cfg.validate(TrainConfig.from_flags(model="llama", data="text", kv_heads=3))
