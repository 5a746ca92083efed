"""Text prepared as shards (`dpax prepare text:PATH DEST`) and streamed: the
windows, and the training, of the text read in memory."""

import json
import shutil

import numpy as np
import pytest

import dpax
from dpax.cli import main
from dpax.cli.evaluate import evaluate_checkpoint
from dpax.cli.train import TrainConfig
from dpax.data import sources, tokenizer
from dpax.data.prepare import prepare_text
from test_gpt import write_corpus

SEQ = 16
MODEL = ["--model", "gpt", "--layers", "1", "--width", "32", "--heads", "2"]


def params_of(run) -> dict:
    with np.load(run / "params.npz") as f:
        return {k: f[k] for k in f.files}


def same_params(a, b) -> bool:
    a, b = params_of(a), params_of(b)
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), n_docs=60, seed=5)


@pytest.mark.parametrize("packed,spec", [(True, "bytes"), (False, "bpe:300")])
def test_the_prepared_windows_are_the_windows_of_the_text(tmp_path, corpus, packed, spec):
    """Every split's windows and labels, and the tokenizer, read back from the
    shards equal what `text:PATH` makes in memory."""
    dest = str(tmp_path / "prepared")
    meta = prepare_text(corpus, dest, SEQ, spec, packed, progress=False)
    memory = dpax.data.load("text:" + corpus, SEQ, tokenizer_spec=spec, packed=packed)
    assert meta["text"] == {"source": "text:" + corpus, "seq_len": SEQ, "tokenizer": spec,
                            "packed": packed, "train_examples": len(memory.x_train)}
    assert (tmp_path / "prepared" / "tokenizer.json").is_file() == (spec != "bytes")
    streamed = dpax.data.load(dest, SEQ, tokenizer_spec=spec, packed=packed)
    assert isinstance(streamed.x_train, sources.Column)
    assert (streamed.task, streamed.n_out) == ("lm", memory.n_out)
    for split in ("x_train", "y_train", "x_eval", "y_eval"):
        want, got = getattr(memory, split), getattr(streamed, split)
        rows = np.arange(len(want))
        assert got.shape == want.shape and got.dtype == want.dtype, split
        np.testing.assert_array_equal(got[rows], want, err_msg=split)
    text = b"def x(self): return x"
    assert streamed.tokenizer.encode(text).tolist() == memory.tokenizer.encode(text).tolist()


def prepared_and_memory_runs(tmp_path, corpus, *extra, spec="bytes", seed=0):
    """`dpax prepare`'s packed windows and the text in memory, in tokens of
    `spec`, each trained on 2 devices from `seed` (`extra`: flags of the
    streamed run)."""
    dest = tmp_path / "prepared"
    cut = ["--seq-len", str(SEQ), "--pack", "--tokenizer", spec]
    assert main(["prepare", f"text:{corpus}", str(dest), *cut, "--quiet"]) == 0
    flags = [*MODEL, *cut, "--batch-size", "6", "--steps", "8", "--devices", "2",
             "--log-every", "4", "--seed", str(seed), "--quiet"]
    assert main(["train", *flags, "--data", f"text:{corpus}", "--out",
                 str(tmp_path / "memory")]) == 0
    streamed = [*flags, "--data", str(dest), *extra]
    assert main(["train", *streamed, "--out", str(tmp_path / "streamed")]) == 0
    return streamed


def test_a_prepared_packed_text_trains_what_the_text_trains(tmp_path, corpus):
    """Streamed windows train bit for bit what the same text in memory trains."""
    prepared_and_memory_runs(tmp_path, corpus)
    assert same_params(tmp_path / "memory", tmp_path / "streamed")


@pytest.mark.slow
def test_a_prepared_text_run_resumes_exactly(tmp_path, corpus):
    """A streamed run of BPE tokens from another seed (other init, batch
    order and dropout masks) stopped at step 4 resumes to the params of the
    text trained in memory without a stop."""
    ck = tmp_path / "ck"
    streamed = prepared_and_memory_runs(tmp_path, corpus, "--checkpoint-dir", str(ck),
                                        "--checkpoint-every", "4", spec="bpe:300", seed=1)
    shutil.rmtree(ck / "8")
    assert main(["train", *streamed, "--resume", str(ck / "4"), "--out",
                 str(tmp_path / "resumed")]) == 0
    assert same_params(tmp_path / "memory", tmp_path / "streamed")
    assert same_params(tmp_path / "memory", tmp_path / "resumed")
    # dpax eval reads the checkpoint's prepared windows in its own tokens.
    with open(tmp_path / "resumed" / "metrics.jsonl") as f:
        final = [json.loads(line) for line in f][-1]
    ev = evaluate_checkpoint(str(ck))
    assert ev["loss"] == pytest.approx(final["eval_loss"], rel=1e-6)
    # Sampling reads no data: the checkpoint outlives the shards.
    shutil.rmtree(tmp_path / "prepared")
    assert main(["sample", "--checkpoint", str(ck), "--prompt", "def", "--tokens", "4"]) == 0


def test_a_run_must_ask_for_the_windows_the_shards_hold(tmp_path, corpus, capsys):
    dest = str(tmp_path / "prepared")
    prepare_text(corpus, dest, SEQ, packed=True, progress=False)
    for flags, named in (({"seq_len": 32, "pack": True}, "`seq_len=16`"),
                         ({"seq_len": SEQ}, "`pack=True`"),
                         ({"seq_len": SEQ, "pack": True, "tokenizer": "bpe:300"},
                          "`tokenizer=bytes`")):
        config = TrainConfig.from_flags(model="gpt", data=dest, **flags)
        with pytest.raises(dpax.DpaxError, match=named):
            dpax.config.validate(config)
    assert main(["train", "--model", "gpt", "--data", dest, "--seq-len", str(SEQ)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "give --pack" in err, err
    with pytest.raises(dpax.DpaxError, match="needs --model gpt or llama"):
        dpax.config.validate(TrainConfig.from_flags(model="mlp", data=dest, seq_len=SEQ,
                                                    pack=True))
    # A model's own tokenizer must be the one the text was tokenized with.
    bpe = dpax.data.load("text:" + corpus, SEQ, tokenizer_spec="bpe:300").tokenizer
    with pytest.raises(dpax.DpaxError, match="another tokenizer"):
        dpax.data.load(dest, SEQ, packed=True, tok=bpe)


def test_prepare_refuses_a_used_directory_before_reading_the_text(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert main(["prepare", "text:" + str(tmp_path / "missing"), str(used)]) == 2
    assert "already exists" in capsys.readouterr().err  # not "does not exist": checked first
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    assert main(["prepare", "text:" + str(tmp_path), str(tmp_path / "new"),
                 "--tokenizer-from", str(tmp_path / "nowhere")]) == 2
    assert "--tokenizer-from" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()



def test_a_model_tokenizer_prepares_text_its_run_then_reads(tmp_path, corpus):
    """`--tokenizer-from` a model's directory: the windows are in its tokens,
    and a run that starts from that model (its tokenizer) reads them."""
    bpe = dpax.data.load("text:" + corpus, SEQ, tokenizer_spec="bpe:300").tokenizer
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text(bpe.to_json())
    dest = str(tmp_path / "prepared")
    assert main(["prepare", f"text:{corpus}", dest, "--seq-len", str(SEQ), "--tokenizer",
                 "bpe:300", "--tokenizer-from", str(model_dir), "--quiet"]) == 0
    model_tok = tokenizer.from_json("bpe:300", (model_dir / "tokenizer.json").read_text())
    ds = dpax.data.load(dest, SEQ, tokenizer_spec="bpe:300", tok=model_tok)
    words = b"def x(self):\n    return x"
    assert ds.tokenizer.encode(words).tolist() == bpe.encode(words).tolist()
    other = dpax.data.load("text:" + corpus, SEQ, tokenizer_spec="bpe:280").tokenizer
    with pytest.raises(dpax.DpaxError, match="another tokenizer"):
        dpax.data.load(dest, SEQ, tokenizer_spec="bpe:300", tok=other)


def test_shards_of_prepared_text_are_read_as_text_or_refused(tmp_path, corpus, capsys):
    dest = tmp_path / "prepared"
    prepare_text(corpus, str(dest), SEQ, progress=False)
    # A glob of its shards would read the windows' lengths as labels.
    with pytest.raises(dpax.DpaxError, match="give their directory"):
        dpax.data.load(str(dest / "*.array_record"))
    # Prepared text is not prepared again as examples, and each kind's flags are its own.
    for args, says in (([str(dest), str(tmp_path / "again")], "already wrote"),
                       ([f"text:{corpus}", str(tmp_path / "b"), "--x-column", "t"],
                        "--x-column is not for text"),
                       ([str(dest / "labels.npy"), str(tmp_path / "c"), "--pack"],
                        "--pack is not for examples")):
        assert main(["prepare", *args]) == 2
        assert says in capsys.readouterr().err
    # The Python API asks for the windows too.
    with pytest.raises(dpax.DpaxError, match="`seq_len=16`"):
        dpax.data.load(str(dest))
    # A damaged or edited description is one line that says what to do.
    meta = dest / sources.META
    good = meta.read_text()
    for edit, says in ((('"train_examples"', '"train"'), "damaged; write the text again"),
                       (('"seq_len": 16', '"seq_len": "16"'), "damaged; write the text again"),
                       (('"seq_len": 16', '"seq_len": 8'), "does not describe its shards"),
                       (('"packed": false', '"packed": true'), "does not describe its shards")):
        meta.write_text(good.replace(*edit))
        asked = {"seq_len": 8} if "8" in edit[1] else {"packed": "true" in edit[1]}
        with pytest.raises(dpax.DpaxError, match=says):
            dpax.data.load(str(dest), **{"seq_len": SEQ, **asked})
