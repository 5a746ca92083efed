"""The `dpax` command: bad input exits 2 with one line and touches nothing;
a short run through the real entry point writes what it promises."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dpax
from dpax.cli import main
from dpax.cli.command import build_parser
from dpax.cli.exits import as_flags
from dpax.cli.train import TrainConfig
from dpax.parallel import mesh


@pytest.fixture
def run_dir(tmp_path):
    """An existing run directory whose files must survive any bad input."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "params.npz").write_bytes(b"old params")
    return out


def npz(tmp_path, name, **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


def bad_inputs(tmp_path):
    x = np.zeros((10, 3), np.float32)
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    nan_y = np.where(np.arange(10) % 3, 1.0, np.nan)
    streamed = tmp_path / "streamed.parquet"  # inputs read per batch: checked on the first
    import pyarrow as pa
    import pyarrow.parquet as pq

    nan_x = np.ones((10, 3), np.float32)
    nan_x[2, 1] = np.nan
    pq.write_table(pa.table({"x": pa.array(list(nan_x)), "y": pa.array(np.arange(10) % 2)}),
                   streamed)
    # A NaN in the eval split only: found by the first evaluation, after the
    # run wrote its files, unless checked before. Its row: the split's first.
    streamed_eval = tmp_path / "streamed_eval.parquet"
    ids = np.repeat(np.arange(10, dtype=np.float32)[:, None], 3, 1)  # each row its index
    pq.write_table(pa.table({"x": pa.array(list(ids)), "y": pa.array(np.arange(10) % 2)}),
                   streamed_eval)
    eval_row = int(dpax.data.datasets.load(str(streamed_eval)).x_eval[np.arange(1)][0, 0])
    nan_x = np.ones((10, 3), np.float32)
    nan_x[eval_row, 0] = np.nan
    pq.write_table(pa.table({"x": pa.array(list(nan_x)), "y": pa.array(np.arange(10) % 2)}),
                   streamed_eval)
    return {
        "seed negative": (["--seed", "-1"], "--seed"),
        "momentum nan": (["--optimizer", "momentum", "--momentum", "nan"], "--momentum"),
        "momentum 1": (["--momentum", "1"], "--momentum"),
        "weight decay negative": (["--weight-decay", "-1"], "--weight-decay"),
        # Options of another optimizer or model were ignored (trained without them).
        "weight decay with adam": (["--weight-decay", "0.5"],
                                   "--weight-decay is an option of --optimizer adamw, not of "
                                   "--optimizer adam"),
        "momentum with sgd": (["--optimizer", "sgd", "--momentum", "0.5"],
                              "--momentum is an option of --optimizer momentum"),
        "dropout with mlp": (["--model", "mlp", "--dropout", "0.5"],
                             "--dropout is an option of --model gpt and --model llama, not of "
                             "--model mlp"),
        "heads with mlp": (["--model", "mlp", "--heads", "3"], "--heads is an option of"),
        "warmup negative": (["--warmup-steps", "-5"], "--warmup-steps"),
        "timeout 0": (["--timeout", "0"], "--timeout"),
        "timeout negative": (["--timeout", "-1"], "--timeout"),
        "clip nan": (["--clip-norm", "nan"], "--clip-norm"),
        "profile past the end": (["--profile-steps", "50:60", "--steps", "10", "--model", "mlp"],
                                 "starts after"),  # found once the model is built
        "nan in y": (["--model", "mlp", "--data", npz(tmp_path, "nany.npz", x=x, y=nan_y)],
                     "nany.npz: y contains NaN or infinite values in 4 of its 10 examples (the "
                     "first at row 0)"),
        "negative labels": (["--model", "mlp", "--data",
                             npz(tmp_path, "neg.npz", x=x, y=np.arange(10) - 1)],
                            "neg.npz: y holds class labels below 0 (the least is -1)"),
        "halves as classes": (["--model", "mlp", "--task", "classification", "--data",
                               npz(tmp_path, "half.npz", x=x, y=np.arange(10) / 2)],
                              "y holds 0.5, not a whole number, but a classifier takes class "
                              "ids 0..K-1; give --task regression"),
        "a task for digits": (["--task", "regression"], "--task is for the labels of a .npz"),
        "nan in streamed x": (["--model", "mlp", "--data", str(streamed)],
                              "the first batch of --data contains NaN or infinite values in 1 "
                              "of its 8 examples"),
        "nan in streamed eval x": (["--model", "mlp", "--data", str(streamed_eval)],
                                   "the first batch of --data contains NaN or infinite values "
                                   "in 1 of its 2 examples (the first at row 0)"),
        "unknown task": (["--task", "ranking"], "unknown --task 'ranking'"),
        "complex x": (["--model", "mlp", "--data", npz(tmp_path, "cx.npz", x=x + 1j,
                                                        y=np.zeros(10, int))], "complex"),
        "checkpoint dir is a file": (["--checkpoint-dir", str(a_file)], "is a file"),
        "out empty": (["--out", ""], "is empty"),
        "out not writable": (["--out", str(a_file / "run")], "cannot write"),
        "binary config": (["--config", str(binary)], "not a text file"),
        "devices 0": (["--devices", "0"], "--devices"),
        "a binary file as text": (["--model", "gpt", "--data", f"text:{sys.executable}"],
                                  "is not text"),
        "an npz array that is not there": (["--model", "mlp", "--data",
                                            npz(tmp_path, "xy.npz", x=x, y=np.zeros(10)),
                                            "--x-column", "nope"], "(it has x, y)"),
        "devices negative": (["--devices", "-2"], "--devices"),
        "devices over the cap": (["--devices", "100000"], "cap"),
        "batch 0": (["--batch-size", "0"], "--batch-size"),
        "batch not a number": (["--batch-size", "abc"], "batch-size"),
        "unknown model": (["--model", "resnet9000"], "unknown --model"),
        "unknown data": (["--data", "imagenet"], "unknown data"),
        "unknown optimizer": (["--optimizer", "lion"], "unknown --optimizer"),
        "unknown backend": (["--backend", "xmap"], "unknown backend"),
        "missing npz": (["--data", str(tmp_path / "nope.npz")], "does not exist"),
        "corrupt npz": (["--data", str(corrupt)], "not a readable .npz"),
        "npz without y": (["--data", npz(tmp_path, "nox.npz", x=x)], "lacks"),
        "mismatched npz": (["--data", npz(tmp_path, "mis.npz", x=x, y=np.zeros(9))], "y needs"),
        "empty npz": (["--data", npz(tmp_path, "empty.npz", x=x[:0], y=np.zeros(0))],
                      "no examples"),
        "non-numeric npz": (["--data", npz(tmp_path, "str.npz", x=np.array(["a"] * 10),
                                           y=np.zeros(10))], "non-numeric"),
        "lr 0": (["--lr", "0"], "--lr"),
        "lr negative": (["--lr", "-1"], "--lr"),
        "lr nan": (["--lr", "nan"], "--lr"),
        "lr inf": (["--lr", "inf"], "--lr"),
        "out is a file": (["--out", str(a_file)], "is a file"),
        "steps and epochs": (["--steps", "5", "--epochs", "2"], "exactly one"),
        "steps 0": (["--steps", "0"], "--steps"),
        "cnn on flat data": (["--model", "cnn", "--data", "regression"], "NHWC"),
        "unknown sharding": (["--sharding", "zero3"], "--sharding must be one of"),
        "sharded on pmap": (["--sharding", "full", "--backend", "pmap"],
                            "needs --backend shard_map"),
    }


def exit_code(argv):
    """`dpax ARGV` in this process: main's return value, or argparse's exit code."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_every_bad_input_exits_2_with_one_line_and_keeps_the_run_dir(tmp_path, run_dir,
                                                                      capsys):
    before = {p: (run_dir / p).read_bytes() for p in os.listdir(run_dir)}
    for name, (flags, needle) in bad_inputs(tmp_path).items():
        argv = ["train", *flags]
        if "--out" not in flags:  # --overwrite: even then bad input must keep the run
            argv += ["--out", str(run_dir), "--overwrite"]
        if "--steps" not in flags:
            argv += ["--steps", "1"]
        code = exit_code(argv)
        err = capsys.readouterr().err
        assert code == 2, name
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert needle in err and "Traceback" not in err, (name, err)
    assert {p: (run_dir / p).read_bytes() for p in os.listdir(run_dir)} == before
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["run"]  # no partial --out


def test_steps_or_epochs_where_a_count_is_needed():
    with pytest.raises(dpax.DpaxError, match="not both"):
        dpax.config.validate(TrainConfig(epochs=2, steps=3))
    ds = dpax.data.digits()
    t = dpax.Trainer(dpax.make_model("linear", ds.input_shape, ds.n_out, 0),
                     dpax.classification_loss, dpax.make_optimizer("sgd", lambda s: 0.1),
                     devices=1)
    with pytest.raises(dpax.DpaxError, match="exactly one"):
        t.fit(ds.x_train, ds.y_train, batch_size=8)  # Trainer.fit has no default length


def test_more_devices_than_present_is_a_clear_error():
    with pytest.raises(dpax.DpaxError, match="only 8"):
        dpax.select_devices(9)
    with pytest.raises(dpax.DpaxError, match="before any JAX computation"):
        dpax.simulate_devices(16)  # the backend already started with 8
    with pytest.raises(dpax.DpaxError, match="cap"):
        dpax.simulate_devices(mesh.MAX_SIMULATED_DEVICES + 1)


def dpax_cmd(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dpax", *args], capture_output=True,
                          text=True, timeout=300, **kw)


@pytest.mark.slow
@pytest.mark.processes  # starts dpax processes
def test_train_pulse_through_the_real_entry_point(tmp_path):
    out = tmp_path / "pulse"
    r = dpax_cmd("train", "--devices", "2", "--steps", "6", "--batch-size", "50",
                 "--log-every", "3", "--eval-every", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = [ln for ln in r.stdout.splitlines() if ln.startswith("eval accuracy")]
    assert len(summary) == 1 and "steps 6" in summary[0]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6, 6]
    assert rows[0]["examples"] == 150 and np.isfinite(rows[1]["loss"])
    assert "eval_accuracy" in rows[0] and "eval_accuracy" not in rows[1]  # --eval-every 3
    assert 0.0 <= rows[2]["eval_accuracy"] <= 1.0
    with np.load(out / "params.npz") as p:
        assert set(p.files) == {"conv1/kernel", "conv1/bias", "conv2/kernel", "conv2/bias",
                                "dense/kernel", "dense/bias"}
        assert p["conv1/kernel"].shape == (3, 3, 1, 32)


@pytest.mark.slow
@pytest.mark.processes  # starts dpax processes
def test_bad_input_in_a_fresh_process_has_no_traceback(tmp_path):
    r = dpax_cmd("train", "--batch-size", "abc")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = dpax_cmd("train", "--devices", "3", "--data", str(tmp_path / "missing.npz"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.processes  # starts dpax processes
def test_devices_command_lists_what_jax_sees():
    r = dpax_cmd("devices")
    assert r.returncode == 0 and "8 local" in r.stdout


def one_line_error(capsys, argv, code=2):
    """Run `dpax ARGV`; assert it exits `code` with one stderr line and no traceback."""
    assert exit_code(argv) == code, argv
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.slow
def test_an_out_that_holds_a_run_is_refused_and_overwrite_replaces_it(tmp_path, capsys):
    run = tmp_path / "a"
    flags = ["--model", "mlp", "--steps", "4", "--log-every", "2", "--devices", "2"]
    assert main(["train", *flags, "--out", str(run), "--quiet"]) == 0
    (run / "metrics.png").write_bytes(b"a stale plot")
    for log in ("error.log", "error-rank1.log"):  # an earlier failure's details
        (run / log).write_text("Traceback ...")
    before = {p: (run / p).read_bytes() for p in os.listdir(run)}
    capsys.readouterr()
    # config.yaml holds `out: a`: reusing it must not overwrite run a.
    err = one_line_error(capsys, ["train", "--config", str(run / "config.yaml"),
                                  "--lr", "0.01"])
    assert "already holds a run" in err and "--overwrite" in err and "--resume" in err
    assert {p: (run / p).read_bytes() for p in os.listdir(run)} == before
    assert main(["train", "--config", str(run / "config.yaml"), "--lr", "0.01", "--steps",
                 "2", "--overwrite", "--quiet"]) == 0
    assert not (run / "metrics.png").exists()  # the old run's plot would be stale
    assert not (run / "error.log").exists() and not (run / "error-rank1.log").exists()
    failed = tmp_path / "failed"  # an attempt that failed before writing a run
    failed.mkdir()
    (failed / "error.log").write_text("Traceback ...")
    assert main(["train", *flags, "--out", str(failed), "--quiet"]) == 0
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2]
    assert "lr: 0.01" in (run / "config.yaml").read_text()


@pytest.mark.slow
def test_eval_on_data_that_does_not_fit_names_the_difference(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train", "--steps", "3", "--devices", "2", "--checkpoint-dir", ck,
                 "--quiet"]) == 0
    images = np.random.default_rng(0).random((20, 8, 8, 1)).astype(np.float32)
    cases = {
        "random-images": "shape (32, 32, 3)",
        "regression": "shape (5,)",
        npz(tmp_path, "float_y.npz", x=images, y=np.linspace(0, 1, 20)): "regression set",
        npz(tmp_path, "eleven.npz", x=images, y=np.arange(20) % 11): "labels up to 10",
    }
    capsys.readouterr()
    for data, needle in cases.items():
        err = one_line_error(capsys, ["eval", "--checkpoint", ck, "--data", data,
                                      "--devices", "2"])
        assert needle in err and "damaged" not in err and "--model" not in err, err
    # Fewer classes than the model has is fine, and the checkpoint was never damaged.
    three = npz(tmp_path, "three.npz", x=images, y=np.arange(20) % 3)
    assert main(["eval", "--checkpoint", ck, "--data", three, "--devices", "2"]) == 0
    # The rows scored are the file's eval split, and the line says so.
    assert f"examples 4 (the eval split of {three})" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", ck, "--devices", "2"]) == 0
    assert "examples 359" in capsys.readouterr().out


def test_outputs_are_checked_before_the_work(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train", "--model", "mlp", "--steps", "2", "--devices", "2",
                 "--checkpoint-dir", ck, "--out", str(tmp_path / "run"), "--quiet"]) == 0
    x = npz(tmp_path, "x.npz", x=np.zeros((3, 8, 8, 1), np.float32))
    capsys.readouterr()
    for argv, needle in [
        (["predict", "--checkpoint", ck, "--data", x, "--out", str(tmp_path / "no" / "p.npz")],
         "does not exist"),
        (["predict", "--checkpoint", ck, "--data", x, "--out", str(tmp_path / "p.npy")],
         "ending in .npz"),
        (["plot", str(tmp_path / "run"), "--out", str(tmp_path / "no" / "m.png")],
         "does not exist"),
        (["plot", str(tmp_path / "run"), "--out", str(tmp_path / "m.xyz")], ".png"),
        (["eval", "--checkpoint", x], "is a file"),
        # An existing file (here the input itself) is kept unless asked to replace it.
        (["predict", "--checkpoint", ck, "--data", x, "--out", x], "exists"),
    ]:
        assert needle in one_line_error(capsys, argv)
    assert np.load(x)["x"].shape == (3, 8, 8, 1)
    assert main(["predict", "--checkpoint", ck, "--data", x, "--out", x, "--overwrite"]) == 0
    assert np.load(x)["predictions"].shape == (3,)


def test_every_commands_help_works(capsys):
    """argparse %-formats each help string: a stray % (as in "5% of the step")
    crashed `dpax train -h`, which every usage error points to."""
    parser = build_parser()
    for argv in [[]] + [[name] for name in parser.commands]:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith("usage: dpax"), argv

    def squeezed(text):  # argparse rewraps help, and may break a line at a hyphen
        return "".join(text.split())

    for name, sub in parser.commands.items():
        text = squeezed(sub.format_help())
        for action in sub._actions:  # each flag's whole help is shown, % signs included
            if action.help:
                assert squeezed(action.help.replace("%%", "%")) in text, (name, action.dest)


def test_a_failure_is_one_line_and_its_story_is_in_a_file(tmp_path, capsys, monkeypatch):
    """What the libraries log while a run fails (Orbax's errors with their
    tracebacks, a background thread's exception, C code printing a callback's
    error) stays off the terminal: one line names the cause and the file
    that holds all of it."""
    import logging
    import threading

    from dpax.cli import devices, failures

    def failing_run(args):
        failures.current().run_dir = str(tmp_path)
        try:
            raise ValueError("the write failed")
        except ValueError:
            logging.getLogger("absl").error("background save failed", exc_info=True)
        worker = threading.Thread(target=lambda: 1 / 0, name="save_finalize")
        worker.start()
        worker.join()
        sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(devices, "run", failing_run)
    assert main(["devices"]) == 1
    err = capsys.readouterr().err
    log = tmp_path / "error.log"
    assert err == f"dpax: error: OSError: [Errno 28] No space left on device (details in {log})\n"
    text = log.read_text()
    for needle in ("command: dpax devices", "failing_run", "background save failed",
                   "ValueError: the write failed", "exception in thread save_finalize",
                   "ZeroDivisionError", "Event loop is closed"):
        assert needle in text, needle
    # Outside the command, logging and the hooks are as they were.
    assert failures.current() is None and sys.excepthook is sys.__excepthook__

    def run_that_gets_past_errors(args):
        failures.current().run_dir = str(tmp_path / "ok")
        (tmp_path / "ok").mkdir()
        for _ in range(2):  # a warning shows once, without a traceback
            logging.getLogger("orbax").warning("Waiting for the previous save\nsecond line")
        worker = threading.Thread(target=lambda: 1 / 0, name="tracker")
        worker.start()
        worker.join()
        return 0

    monkeypatch.setattr(devices, "run", run_that_gets_past_errors)
    assert main(["devices"]) == 0
    log = tmp_path / "ok" / "error.log"
    assert capsys.readouterr().err.splitlines() == [
        "dpax: warning: Waiting for the previous save",
        "dpax: warning: the libraries reported 1 error(s) while the command ran, which it "
        f"got past; details in {log}"]
    assert "the command succeeded" in log.read_text() and "ZeroDivisionError" in log.read_text()


def test_messages_name_the_command_and_its_flags(capsys):
    assert "(see 'dpax -h')" in one_line_error(capsys, [])
    assert "(see 'dpax train -h')" in one_line_error(capsys, ["train", "--stepz", "3"])
    err = one_line_error(capsys, ["launch", "--nprocs", "2", "--port", "99999", "--", "--steps",
                                  "1"])
    assert "--port must be in 1..65535" in err and "rank" not in err
    # The Python API names arguments; the CLI shows the same message with flags.
    with pytest.raises(dpax.DpaxError, match="`devices=8` or fewer") as e:
        dpax.select_devices(9)
    assert as_flags(str(e.value)).endswith("use --devices 8 or fewer, or call "
                                           "`dpax.simulate_devices(9)` before JAX starts")
    assert as_flags("`sync_batchnorm=False`, `out`, `backend=shard_map`") == \
        "--no-sync-batchnorm, --out, --backend shard_map"
    with pytest.raises(dpax.DpaxError, match="`predict_fn=dpax.classification_predict`"):
        ds = dpax.data.regression()
        dpax.Trainer(dpax.make_model("linear", ds.input_shape, 1, 0), dpax.regression_loss,
                     dpax.make_optimizer("sgd", lambda s: 0.1), devices=1).predict(ds.x_eval)


def test_check_factory_with_the_wrong_signature_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "badfactory.py").write_text("def make(shape, n):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = one_line_error(capsys, ["check", "--factory", "badfactory:make", "--devices", "2"])
    assert "cannot be called as FN(input_shape, n_out, rngs=nnx.Rngs)" in err


@pytest.mark.slow
def test_resume_auto_starts_without_a_checkpoint_and_continues_with_one(tmp_path, capsys):
    """One command line for a requeued job, whatever the checkpoint dir holds."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    flags = ["train", "--model", "mlp", "--devices", "2", "--checkpoint-dir", ck, "--resume",
             "auto", "--out", out, "--quiet"]
    assert main([*flags, "--steps", "6"]) == 0  # nothing to resume: it starts
    assert main([*flags, "--steps", "12"]) == 0  # continues at step 6
    assert "resumed at step 6" not in capsys.readouterr().out  # --quiet
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "loss" in r] == [6, 10, 12]
    assert main(["train", "--resume", "auto"]) == 2
    assert ("--resume auto resumes from the newest checkpoint in --checkpoint-dir"
            in capsys.readouterr().err)
    # An option left to its default reads so, not as Python's None.
    assert main([*flags, "--steps", "14", "--lr", "0.01"]) == 2
    assert "--lr was not given in the checkpoint, now 0.01" in capsys.readouterr().err
    # Without `resume` the directory is another run's: its saves would not be made.
    before = sorted(os.listdir(ck))
    assert main(["train", "--model", "mlp", "--devices", "2", "--steps", "3",
                 "--checkpoint-dir", ck, "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"dpax: error: --checkpoint-dir {ck} holds another run's checkpoints (steps 6, 12); "
        "give --resume to continue that run, or an empty --checkpoint-dir\n")
    assert sorted(os.listdir(ck)) == before
    # The same run again without --resume: the refusal names the checkpoints
    # that --overwrite keeps, so it is not followed by a second refusal.
    again = ["train", "--model", "mlp", "--devices", "2", "--steps", "12", "--checkpoint-dir",
             ck, "--out", out, "--quiet"]
    assert main(again) == 2
    assert capsys.readouterr().err == (
        f"dpax: error: --out {out} already holds a run; give a new --out, --overwrite to "
        f"replace it (with an empty --checkpoint-dir: {ck} holds checkpoints, which "
        "--overwrite keeps), or --resume to continue it\n")
    assert main([*again, "--overwrite"]) == 2
    assert "(steps 6, 12), which --overwrite keeps; give --resume" in capsys.readouterr().err
    assert sorted(os.listdir(ck)) == before and os.path.exists(f"{out}/metrics.jsonl")


def test_prepare_names_every_source_it_takes(tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "nope.npz"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Parquet" in err and "Hugging Face" in err, err


def test_warnings_are_one_line_and_the_run_goes_on(tmp_path, capsys):
    x = np.random.default_rng(0).random((40, 6)).astype(np.float32)
    sparse = npz(tmp_path, "sparse.npz", x=x, y=np.where(np.arange(40) % 2, 1000, 0))
    whole = npz(tmp_path, "whole.npz", x=x, y=(np.arange(40) % 3).astype(np.float32))
    # The MLP throughout: no warning depends on the model, and its steps
    # compile faster than the default CNN's.
    for argv, needle in [(["--warmup-steps", "100", "--steps", "10", "--devices", "2",
                           "--model", "mlp"], "never reaches"),
                         (["--data", sparse, "--model", "mlp", "--steps", "2", "--devices", "1"],
                          "2 distinct labels but its largest is 1000"),
                         (["--data", whole, "--model", "mlp", "--steps", "2", "--devices", "1"],
                          "y is float32 but holds only whole numbers (3 distinct, 0..2), so a "
                          "regression is trained on it; for a classifier of 3 classes give "
                          "--task classification"),
                         (["--batch-size", "3", "--devices", "8", "--steps", "2", "--model",
                           "mlp"],
                          "5 of them see only padding every step; use a --batch-size that")]:
        assert main(["train", *argv, "--quiet"]) == 0
        err = capsys.readouterr().err
        assert err.startswith("dpax: warning: ") and needle in err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("sharding,built_on", [("replicated", 0), ("full", 7)])
def test_dpax_train_builds_a_split_layouts_model_in_host_memory(monkeypatch, sharding,
                                                                built_on):
    """A split layout exists for a state that does not fit one device: its
    model is built on the host's CPU device, not whole on the first device
    (device 7 stands in for the host here)."""
    import jax
    from flax import nnx

    from dpax.cli import job

    monkeypatch.setattr(job, "host_device", lambda: jax.devices()[7])
    config = TrainConfig.from_flags(model="mlp", devices=2, sharding=sharding)
    t = job.make_trainer(config, "classification", (64,), 10, total=10)
    placed = {d for x in jax.tree.leaves(nnx.state(t._user_model)) for d in x.devices()}
    assert placed == {jax.devices()[built_on]}


def test_the_task_decides_what_a_npz_trains_and_a_resume_keeps_it(tmp_path, capsys):
    """Whole-number float labels train a classifier with --task classification
    (as integer labels would), integer labels a regression with --task
    regression; either way no warning, and a resume may not change it."""
    from dpax.cli.job import check_same_meaning
    from dpax.data.datasets import from_npz

    x = np.random.default_rng(0).random((40, 6)).astype(np.float32)
    y = np.arange(40) % 3
    floats = npz(tmp_path, "floats.npz", x=x, y=y.astype(np.float32))
    ints = npz(tmp_path, "ints.npz", x=x, y=y)
    as_classes = from_npz(floats, task="classification")
    assert (as_classes.task, as_classes.n_out, as_classes.y_train.dtype) == (
        "classification", 3, np.int32)
    assert np.array_equal(as_classes.y_train, from_npz(ints).y_train)
    as_numbers = from_npz(ints, task="regression")
    assert (as_numbers.task, as_numbers.n_out, as_numbers.y_train.dtype) == (
        "regression", 1, np.float32)
    out = tmp_path / "run"
    assert main(["train", "--data", floats, "--task", "classification", "--model", "mlp",
                 "--steps", "2", "--devices", "1", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # no warning: the task was given
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert "eval_accuracy" in rows[-1]
    assert "task: classification" in (out / "config.yaml").read_text()
    was = dpax.config.to_dict(TrainConfig.from_flags(data=floats, task="classification"))
    with pytest.raises(dpax.DpaxError, match="cannot resume: `task` was 'classification'"):
        check_same_meaning(was, TrainConfig.from_flags(data=floats))


def test_a_platform_jax_cannot_start_is_one_line(monkeypatch, capsys):
    """JAX_PLATFORMS=cuda on a host without CUDA: JAX fails an assert inside
    its backend setup; every command now says what to change (exit 2)."""
    from dpax.cli import devices

    cpu = devices.jax.devices

    def no_backend(*backend):  # the default backend fails; the CPU one is asked for too
        if backend:
            return cpu(*backend)
        raise AssertionError

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setattr(devices.jax, "devices", no_backend)
    for command in (["devices"], ["estimate", "--model", "mlp"]):
        err = one_line_error(capsys, command)
        assert "JAX cannot start a backend for JAX_PLATFORMS=cuda" in err, command


def test_messages_suggest_only_what_the_command_takes(tmp_path, capsys):
    """predict takes no --x-column, and --loss wants a loss, not a model."""
    err = one_line_error(capsys, ["check", "--loss", "nomod", "--devices", "2"])
    assert "e.g. mylosses:my_loss" in err
    nox = npz(tmp_path, "nox.npz", z=np.zeros((3, 8, 8, 1), np.float32))
    err = one_line_error(capsys, ["predict", "--checkpoint", str(tmp_path / "none"), "--data",
                                  nox, "--out", str(tmp_path / "p.npz")])
    assert "lacks array(s) x" in err and "--x-column" not in err


def test_version_names_dpax_and_its_stack_on_one_line(capsys):
    import flax
    import jax

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.count("\n") == 1
    assert out.startswith(f"dpax {dpax.__version__} (jax {jax.__version__},")
    assert f"flax {flax.__version__}" in out


@pytest.mark.parametrize("flags,needle", [
    (["--steps", "2", "--bogus-flag", "3"], "unrecognized arguments: --bogus-flag 3"),
    (["--steps", "-2"], "--steps must be >= 1, got -2"),
    (["--devices-per-process", "2"], "--devices-per-process is dpax launch's own: give it "
                                     "before `--`"),
])
def test_launch_refuses_bad_train_flags_once_before_any_rank_starts(flags, needle, capsys,
                                                                     monkeypatch):
    """Every rank printed the same error after starting JAX; the launcher
    says it once, as `dpax train` would, and starts nothing."""
    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(subprocess, "Popen", no_rank)
    try:
        code = main(["launch", "--nprocs", "2", "--", *flags])
    except SystemExit as e:  # argparse's own exit, as for `dpax train`
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and "[rank" not in err, err
