"""A byte-level BPE trained on the training text (`--tokenizer bpe:VOCAB`):
deterministic, kept with the run, bits per byte over the bytes the tokens
cover, N devices equal one, and the tokenizer travels with exports and
imports in Hugging Face's layout."""

import json
import math
import os

import numpy as np
import pytest

from dpax.cli import main
from dpax.data import text, tokenizer
from test_gpt import write_corpus

VOCAB = 300
FLAGS = ["--model", "gpt", "--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16",
         "--tokenizer", f"bpe:{VOCAB}", "--batch-size", "13", "--optimizer", "sgd", "--lr",
         "0.3", "--log-every", "4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), n_docs=60)


def test_the_bpe_is_deterministic_and_gives_the_text_back(corpus):
    train, held = text.split(text.documents(corpus, 16))
    a, b = (tokenizer.train(f"bpe:{VOCAB}", train) for _ in range(2))
    assert a.to_json() == b.to_json() and a.vocab == VOCAB
    for doc in held + train[:5]:
        assert a.decode(a.encode(doc)) == doc
    assert sum(map(len, a.encode_all(held))) < 0.6 * sum(map(len, held))  # it compresses
    assert tokenizer.from_json(f"bpe:{VOCAB}", a.to_json()).encode(held[0]).tolist() == \
        a.encode(held[0]).tolist()


@pytest.mark.slow
def test_bits_per_byte_are_over_the_bytes_the_tokens_cover(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *FLAGS, "--data", f"text:{corpus}", "--steps", "8",
                 "--out", str(out)]) == 0
    tok = tokenizer.from_json(f"bpe:{VOCAB}", (out / "tokenizer.json").read_text())
    # The eval windows' targets and the bytes they stand for, counted here.
    _, _, _, x_eval, y_eval, _ = text.load(corpus, 16, tok=tok)
    targets = np.concatenate([x[1:n] for x, n in zip(x_eval, y_eval)])
    per_token = tok.token_bytes[targets].sum() / len(targets)
    last = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
    print(f"eval: {per_token:.3f} bytes per token, {last['eval_bpb']:.3f} bits per byte")
    assert math.isclose(last["eval_bytes_per_token"], per_token, rel_tol=1e-5)
    assert math.isclose(last["eval_bpb"], last["eval_loss"] / math.log(2) / per_token,
                        rel_tol=1e-9)
    assert per_token > 1.5 and per_token < 8  # a BPE token covers several bytes of this text


@pytest.mark.slow
def test_a_bpe_run_on_4_devices_equals_1(corpus, tmp_path):
    runs = {}
    for n in (1, 4):
        out = tmp_path / f"n{n}"
        assert main(["train", *FLAGS, "--data", f"text:{corpus}", "--steps", "8",
                     "--devices", str(n), "--out", str(out)]) == 0
        runs[n] = dict(np.load(out / "params.npz"))
    diff = max(float(np.max(np.abs(runs[4][k] - runs[1][k]))) for k in runs[1])
    print(f"bpe:{VOCAB} GPT, 4 vs 1 devices: params {diff:.1e}")
    assert diff <= 1e-5
    assert runs[1]["wte/embedding"].shape == (VOCAB, 32)


@pytest.mark.slow
@pytest.mark.interop
def test_the_tokenizer_travels_with_checkpoints_exports_and_imports(corpus, tmp_path, capsys):
    from transformers import AutoTokenizer

    ck, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    assert main(["train", *FLAGS, "--data", f"text:{corpus}", "--steps", "4",
                 "--checkpoint-dir", ck, "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["sample", "--checkpoint", ck, "--prompt", "def ", "--tokens", "6",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["export", "--checkpoint", ck, "--out", hf]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(hf))
    ours = tokenizer.from_json(f"bpe:{VOCAB}", open(os.path.join(hf, "tokenizer.json")).read())
    theirs = AutoTokenizer.from_pretrained(hf)
    sample = "def x(self):\n    return self"
    assert theirs(sample)["input_ids"] == ours.encode(sample.encode()).tolist()
    # A fine-tune from the export uses the export's tokenizer, not a new one.
    capsys.readouterr()
    args = ["train", *FLAGS, "--data", f"text:{corpus}", "--init-from", hf, "--steps", "2"]
    assert main([*args, "--tokenizer", "bytes"]) == 2  # the last --tokenizer counts
    assert f"give --tokenizer bpe:{VOCAB}" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "ft")]) == 0
    assert (tmp_path / "ft" / "tokenizer.json").read_text() == ours.to_json()


def test_a_bad_tokenizer_is_one_line(corpus, capsys):
    assert main(["train", "--model", "gpt", "--data", f"text:{corpus}", "--tokenizer",
                 "bpe:10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bpe:VOCAB with 257 <= VOCAB" in err[0]
