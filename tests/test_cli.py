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
    return {
        "devices 0": (["--devices", "0"], "--devices"),
        "devices negative": (["--devices", "-2"], "--devices"),
        "devices over the cap": (["--devices", "100000"], "cap"),
        "batch 0": (["--batch-size", "0"], "--batch-size"),
        "batch not a number": (["--batch-size", "abc"], "batch-size"),
        "unknown model": (["--model", "resnet9000"], "unknown model"),
        "unknown data": (["--data", "imagenet"], "unknown data"),
        "unknown optimizer": (["--optimizer", "lion"], "unknown optimizer"),
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
        if "--out" not in flags:
            argv += ["--out", str(run_dir)]
        if "--steps" not in flags:
            argv += ["--steps", "1"]
        code = exit_code(argv)
        err = capsys.readouterr().err
        assert code == 2, name
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert needle in err and "Traceback" not in err, (name, err)
    assert {p: (run_dir / p).read_bytes() for p in os.listdir(run_dir)} == before


def test_steps_or_epochs_where_a_count_is_needed():
    with pytest.raises(dpax.DpaxError, match="not both"):
        dpax.TrainConfig(epochs=2, steps=3).validate()
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
        dpax.simulate_devices(dpax.MAX_SIMULATED_DEVICES + 1)


def dpax_cmd(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dpax", *args], capture_output=True,
                          text=True, timeout=300, **kw)


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


def test_bad_input_in_a_fresh_process_has_no_traceback(tmp_path):
    r = dpax_cmd("train", "--batch-size", "abc")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = dpax_cmd("train", "--devices", "3", "--data", str(tmp_path / "missing.npz"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_devices_command_lists_what_jax_sees():
    r = dpax_cmd("devices")
    assert r.returncode == 0 and "8 local" in r.stdout
