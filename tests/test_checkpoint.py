"""Checkpoints: exact resume after kill -9 and SIGTERM, elastic resume on other
device counts, fallback past damaged checkpoints, eval and predict from one."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dpax
from conftest import max_diff
from dpax.cli import main

pytestmark = pytest.mark.slow  # starts dpax processes or trains long

RUN = ["--model", "mlp", "--optimizer", "momentum", "--lr", "0.05", "--batch-size", "61",
       "--log-every", "5"]


def params(out):
    with np.load(os.path.join(out, "params.npz")) as p:
        return {k: p[k] for k in p.files}


def train_rows(out):
    rows = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    return [r["step"] for r in rows if "loss" in r]


def start(*args):
    return subprocess.Popen([sys.executable, "-m", "dpax", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path, proc, timeout=120):
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_kill_9_then_resume_is_bit_identical(tmp_path, backend, capsys):
    flags = [*RUN, "--devices", "4", "--backend", backend, "--steps", "300"]
    assert main(["train", *flags, "--out", str(tmp_path / "ref")]) == 0
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    p = start(*flags, "--checkpoint-dir", ck, "--checkpoint-every", "10", "--out", out)
    wait_for(os.path.join(ck, "10"), p)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    assert main(["train", *flags, "--checkpoint-dir", ck, "--checkpoint-every", "10",
                 "--out", out, "--resume"]) == 0
    assert "resumed at step" in capsys.readouterr().out
    assert max_diff(params(out), params(tmp_path / "ref")) == 0.0  # bit-identical
    assert train_rows(out) == list(range(5, 301, 5))  # every logged step once


def test_save_on_8_resume_on_4_then_on_1(tmp_path, capsys):
    flags = [*RUN, "--optimizer", "sgd", "--steps", "30"]
    a, b, c = (str(tmp_path / n) for n in "abc")
    assert main(["train", *flags, "--devices", "8", "--checkpoint-dir", f"{a}/ck",
                 "--checkpoint-every", "10", "--out", a]) == 0
    assert main(["train", *flags, "--devices", "4", "--backend", "pmap", "--resume",
                 f"{a}/ck/10", "--checkpoint-dir", f"{b}/ck", "--checkpoint-every", "10",
                 "--out", b]) == 0
    assert main(["train", *flags, "--devices", "1", "--resume", f"{b}/ck/20",
                 "--out", c]) == 0
    diff = max_diff(params(c), params(a))
    print(f"8 -> 4 -> 1 devices vs uninterrupted 8: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def children(pid):
    """Processes started by any thread of `pid`."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return found


def test_kill_9_mid_epoch_on_streamed_augmented_data_resumes_on_2_devices(tmp_path, capsys):
    """ArrayRecord shards, crop+flip, an uneven batch: killed on 4 devices at
    step 30 (mid-epoch 4) with a Grain worker, resumed on 2 without one, it ends
    where an uninterrupted run does; the worker does not outlive the kill."""
    from test_sources import images

    x, y = images(n=500)
    shards = str(tmp_path / "shards")
    dpax.data.prepare.write_shards(shards, [x], y, shard_bytes=100 * 192, progress=False)
    flags = ["--model", "cnn", "--data", shards, "--augment", "crop,flip", "--batch-size",
             "45", "--steps", "80", "--log-every", "5", "--optimizer", "adam", "--lr", "0.001"]
    assert main(["train", *flags, "--devices", "2", "--out", str(tmp_path / "ref")]) == 0
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    p = start(*flags, "--devices", "4", "--checkpoint-dir", ck, "--checkpoint-every", "10",
              "--out", out, "--data-workers", "1")
    wait_for(os.path.join(ck, "30"), p)
    workers = children(p.pid)  # Grain's worker (and multiprocessing's resource tracker)
    assert workers
    p.send_signal(signal.SIGKILL)
    p.communicate()
    t0 = time.monotonic()  # the worker sees its parent gone within a second or so
    while any(os.path.exists(f"/proc/{w}") for w in workers):
        assert time.monotonic() - t0 < 10, "a Grain worker outlived its killed run"
        time.sleep(0.1)
    assert main(["train", *flags, "--devices", "2", "--checkpoint-dir", ck, "--out", out,
                 "--resume"]) == 0  # on the training thread: no workers this time
    assert "resumed at step" in capsys.readouterr().out
    diff = max_diff(params(out), params(tmp_path / "ref"))
    print(f"streamed + augmented, killed on 4, resumed on 2 vs uninterrupted: {diff:.2e}")
    assert diff <= 1e-5
    assert train_rows(out) == list(range(5, 81, 5))


def test_sigterm_saves_exits_4_and_resumes_exactly(tmp_path, capsys):
    flags = [*RUN, "--devices", "2", "--steps", "400"]
    assert main(["train", *flags, "--out", str(tmp_path / "ref")]) == 0
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    p = start(*flags, "--checkpoint-dir", ck, "--out", out)  # no periodic saves at all
    for line in p.stdout:
        if line.startswith("step 20/"):
            break
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 4, err
    assert "checkpoint saved" in err and "Traceback" not in err
    saved = [int(d) for d in os.listdir(ck) if d.isdigit()]
    assert len(saved) == 1 and 20 <= saved[0] < 400
    assert main(["train", *flags, "--checkpoint-dir", ck, "--out", out, "--resume"]) == 0
    assert max_diff(params(out), params(tmp_path / "ref")) == 0.0


def garble(step_dir):
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                size = fh.seek(0, 2)
                fh.seek(0)
                fh.write(b"\x00garbage\xff" * max(1, size // 9))
                fh.truncate(size // 2)


def test_damaged_newest_checkpoint_falls_back_and_all_damaged_exit_2(tmp_path, capsys):
    flags = [*RUN, "--devices", "2", "--steps", "30"]
    ck = str(tmp_path / "ck")
    assert main(["train", *flags, "--checkpoint-dir", ck, "--checkpoint-every", "10"]) == 0
    ref = dpax.cli.job.load_checkpoint(ck).trainer.params
    garble(os.path.join(ck, "30"))
    capsys.readouterr()
    out = str(tmp_path / "resumed")
    assert main(["train", *flags, "--checkpoint-dir", ck, "--resume", "--out", out]) == 0
    captured = capsys.readouterr()
    warnings = [ln for ln in captured.err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "step 30" in warnings[0]
    assert "resumed at step 20" in captured.out
    got = params(out)  # retrained 20 -> 30 from the good step 20: the same params
    assert max_diff(got, dpax.cli.outputs.flat_params(ref)) == 0.0
    for step in dpax.training.checkpoint.Checkpointer(ck).steps():
        garble(os.path.join(ck, str(step)))
    capsys.readouterr()
    assert main(["train", *flags, "--checkpoint-dir", ck, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no readable checkpoint" in err.splitlines()[-1] and "Traceback" not in err


def test_resume_refuses_a_changed_meaning_but_allows_other_devices(tmp_path, capsys):
    flags = [*RUN, "--steps", "10"]
    ck = str(tmp_path / "ck")
    assert main(["train", *flags, "--devices", "2", "--checkpoint-dir", ck]) == 0
    capsys.readouterr()
    assert main(["train", *RUN, "--steps", "10", "--lr", "0.5", "--checkpoint-dir", ck,
                 "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--lr was 0.05" in err
    assert main(["train", *flags, "--devices", "8", "--backend", "pmap", "--checkpoint-dir",
                 ck, "--resume"]) == 0


def test_eval_and_predict_from_a_checkpoint(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train", "--steps", "40", "--log-every", "20", "--devices", "8",
                 "--checkpoint-dir", ck]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    acc = printed.split("eval accuracy ")[1].split()[0]
    assert main(["eval", "--checkpoint", ck, "--devices", "3"]) == 0
    assert f"eval accuracy {acc}" in capsys.readouterr().out
    x = dpax.data.digits().x_eval
    np.savez(tmp_path / "x.npz", x=x)
    preds_path = str(tmp_path / "preds.npz")
    assert main(["predict", "--checkpoint", f"{ck}/40", "--data", str(tmp_path / "x.npz"),
                 "--out", preds_path, "--devices", "8"]) == 0
    preds = np.load(preds_path)["predictions"]
    assert preds.shape == (len(x),)
    assert float(acc) == pytest.approx(np.mean(preds == dpax.data.digits().y_eval), abs=1e-3)
    assert main(["eval", "--checkpoint", str(tmp_path / "nowhere")]) == 2
