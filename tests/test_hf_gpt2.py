"""Hugging Face GPT-2 weights in and out of dpax's GPT, checked against
`transformers`' own GPT2LMHeadModel (PyTorch, float32; a small GPT-2 made
from a GPT2Config: nothing is downloaded): the same logits both ways, and a
fine-tune from imported weights on 4 devices equal to 1. The comparisons
with `transformers` are marked `interop` (torch and transformers come with
`pip install -e '.[interop]'`, `make test-interop`); the refusals read
directories dpax writes itself."""

import errno
import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import dpax.cli.outputs
from conftest import forward
from dpax.cli import main
from dpax.cli.job import TrainConfig, build, load_checkpoint
from dpax.models import hf_files, hf_gpt2
from dpax.models.gpt import GPT
from test_gpt import write_corpus

SHAPE = {"n_layer": 2, "n_embd": 32, "n_head": 2}
FLAGS = ["--model", "gpt", "--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16"]
TOLERANCE = 1e-4  # float32 logits, two frameworks' kernels


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A GPT-2 as `save_pretrained` writes it, every weight random (LayerNorms
    and biases too, so that a swapped or transposed one shows), with more
    positions (32) than dpax's runs use (16)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **SHAPE)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """The same shape as `gpt2_dir`, written by dpax (`hf_gpt2.save`): what
    the refusals read, without torch."""
    path = tmp_path_factory.mktemp("saved")
    model = GPT(256, 32, layers=2, width=32, heads=2, rngs=nnx.Rngs(0))
    hf_gpt2.save(model, str(path))
    return str(path), model


def test_a_directory_dpax_writes_loads_with_the_same_logits(saved_dir, corpus):
    """The import's own round trip, without torch: `transformers`' reading is
    the interop tier's."""
    path, source = saved_dir
    job = build(TrainConfig.from_flags(data=f"text:{corpus}", init_from=path, **_flags()))
    tokens = np.random.default_rng(0).integers(0, 256, (4, 16))
    diff = np.max(np.abs(np.asarray(forward(job.trainer.model(), tokens))
                         - np.asarray(forward(source, tokens))))
    assert diff == 0.0


@pytest.mark.interop
def test_hugging_faces_gpt2_loads_with_the_same_logits(gpt2_dir, corpus):
    path, hf = gpt2_dir
    job = build(TrainConfig.from_flags(data=f"text:{corpus}", init_from=path, **_flags()))
    model = job.trainer.model()
    tokens = np.random.default_rng(0).integers(0, 256, (4, 16))
    diff = float(np.max(np.abs(np.asarray(forward(model, tokens)) - hf_logits(hf, tokens))))
    print(f"Hugging Face GPT-2 -> dpax: max |logit diff| {diff:.1e}")
    assert diff <= TOLERANCE


@pytest.mark.slow
@pytest.mark.interop
def test_a_dpax_checkpoint_exports_to_what_transformers_loads(tmp_path, corpus, capsys,
                                                              monkeypatch):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    assert main(["train", *FLAGS, "--data", f"text:{corpus}", "--steps", "6", "--dropout",
                 "0.1", "--checkpoint-dir", ck, "--out", str(tmp_path / "run")]) == 0
    assert main(["export", "--checkpoint", ck, "--out", out]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    model = load_checkpoint(ck, devices=1).trainer.model()
    model.eval()  # dropout off, as in Hugging Face's eval()
    tokens = np.random.default_rng(1).integers(0, 256, (4, 16))
    diff = float(np.max(np.abs(np.asarray(forward(model, tokens)) - hf_logits(hf, tokens))))
    with capsys.disabled():
        print(f"dpax -> Hugging Face GPT-2: max |logit diff| {diff:.1e}")
    assert diff <= TOLERANCE
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["resid_pdrop"] == 0.1 and config["attn_pdrop"] == 0.0
    assert "transformer.wte.weight" in load_file(os.path.join(out, "model.safetensors"))
    capsys.readouterr()
    assert main(["export", "--checkpoint", ck, "--out", out]) == 2
    assert "already holds a model (model.safetensors, config.json)" in capsys.readouterr().err
    # Where nothing can be written: one line, exit 2, before the checkpoint is read.
    under_a_file = os.path.join(out, "config.json", "hf")
    assert main(["export", "--checkpoint", ck, "--out", under_a_file]) == 2
    assert capsys.readouterr().err == (f"dpax: error: --out {under_a_file}: "
                                       f"{out}/config.json is a file, not a directory\n")
    def read_only(*args, **kwargs):  # as a read-only or immutable directory answers
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(dpax.cli.outputs.tempfile, "NamedTemporaryFile", read_only)
    assert main(["export", "--checkpoint", ck, "--out", f"{out}/hf"]) == 2
    assert capsys.readouterr().err == (f"dpax: error: cannot write --out {out}/hf: Read-only "
                                       "file system; give a writable directory\n")
    assert not os.path.exists(f"{out}/hf.partial")


@pytest.mark.slow
def test_export_overwrite_replaces_its_own_files_and_keeps_the_users(tmp_path, corpus, capsys):
    """`--overwrite` as `dpax train --overwrite` does it: the model's files go
    (with a tokenizer that the new export lacks), the user's stay, a shard
    index among them: readers, dpax's own too, take model.safetensors before
    it. Every file gets the mode the umask gives (safetensors writes its file
    0600)."""
    ck, out = str(tmp_path / "ck"), tmp_path / "hf"
    assert main(["train", *FLAGS, "--data", f"text:{corpus}", "--steps", "2",
                 "--checkpoint-dir", ck]) == 0
    out.mkdir()
    (out / "README.md").write_text("my notes")  # not a model: no --overwrite needed
    (out / "notes").mkdir()
    umask = os.umask(0o027)
    try:
        assert main(["export", "--checkpoint", ck, "--out", str(out)]) == 0
        assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors",
                                           "notes"]
        for name in ("config.json", "model.safetensors"):
            assert os.stat(out / name).st_mode & 0o777 == 0o640, name
        fresh = tmp_path / "fresh"
        assert main(["export", "--checkpoint", ck, "--out", str(fresh)]) == 0
        assert {os.stat(fresh / n).st_mode & 0o777 for n in os.listdir(fresh)} == {0o640}
        assert os.stat(fresh).st_mode & 0o777 == 0o750
    finally:
        os.umask(umask)
    (out / "model.safetensors.index.json").write_text("{}")  # left by an earlier save
    (out / "tokenizer.json").write_text("{}")  # an earlier export's BPE: this one has none
    assert main(["export", "--checkpoint", ck, "--out", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors",
                                       "model.safetensors.index.json", "notes"]
    assert (out / "README.md").read_text() == "my notes"
    assert sorted(os.listdir(tmp_path)) == ["ck", "fresh", "hf"]  # no partial directory
    exported = load_file(out / "model.safetensors")
    # The index names no file: the weights come first.
    read = hf_files.tensors(str(out), "transformer.")
    assert set(read) == {k.removeprefix("transformer.") for k in exported}


@pytest.mark.slow
@pytest.mark.interop
def test_a_fine_tune_from_imported_weights_on_4_devices_equals_1(gpt2_dir, corpus, tmp_path):
    path, _ = gpt2_dir
    runs = {}
    for n in (1, 4):
        out = tmp_path / f"n{n}"
        assert main(["train", *FLAGS, "--data", f"text:{corpus}", "--init-from", path,
                     "--batch-size", "13", "--steps", "8", "--optimizer", "sgd", "--lr", "0.1",
                     "--devices", str(n), "--out", str(out)]) == 0
        runs[n] = dict(np.load(out / "params.npz"))
    diff = max(float(np.max(np.abs(runs[4][k] - runs[1][k]))) for k in runs[1])
    start = load_file(os.path.join(path, "model.safetensors"))["transformer.h.0.mlp.c_fc.weight"]
    moved = float(np.max(np.abs(runs[1]["blocks/0/up/kernel"] - start)))
    print(f"fine-tune from GPT-2 weights, 4 vs 1 devices: params {diff:.1e} "
          f"(moved {moved:.1e} from the import)")
    assert diff <= 1e-5
    assert 0 < moved < 0.5  # it trained, from the imported weights


def _flags(**over):
    base = {"model": "gpt", "layers": 2, "width": 32, "heads": 2, "seq_len": 16}
    return {**base, **over}


def test_bad_imports_are_one_line_errors(saved_dir, corpus, tmp_path, capsys):
    path, _ = saved_dir
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    exact_gelu = tmp_path / "gelu"
    exact_gelu.mkdir()
    (exact_gelu / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "activation_function": "gelu", **SHAPE}))
    cases = [
        (["--init-from", path, "--layers", "3"], "give --layers 2 --width 32 --heads 2"),
        (["--init-from", path, "--seq-len", "64"], "fewer than --seq-len 64"),
        (["--init-from", str(tmp_path / "nowhere")], "no config.json"),
        (["--init-from", str(other)], "'bert' model"),
        (["--init-from", str(exact_gelu)], "activation 'gelu'"),
        (["--init-from", path, "--model", "cnn", "--data", "digits"], "--model cnn takes none"),
    ]
    for extra, message in cases:
        args = ["train", *FLAGS, "--data", f"text:{corpus}", "--steps", "1", *extra,
                "--out", str(tmp_path / "run")]
        assert main(args) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)
    assert not os.path.exists(tmp_path / "run")  # nothing written
