"""What users see: progress bar or lines, metric writers, plots, profiles, and
a config file that reruns a run exactly."""

import fcntl
import glob
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest

from dpax.cli import main
from dpax.errors import DpaxError

RUN = ["--model", "mlp", "--devices", "4", "--steps", "30", "--log-every", "10",
       "--eval-every", "10", "--skip-nonfinite"]  # the guard logs grad_norm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run with every writer and a profile, and its rerun from config.yaml."""
    base = tmp_path_factory.mktemp("runs")
    a, b = str(base / "a"), str(base / "b")
    assert main(["train", *RUN, "--tensorboard", "--profile-steps", "12:14", "--quiet",
                 "--out", a]) == 0
    assert main(["train", "--config", os.path.join(a, "config.yaml"), "--out", b,
                 "--no-tensorboard", "--profile-steps", "1:1"]) == 0
    return a, b


def test_rerun_from_config_yaml_is_bit_identical(runs):
    a, b = runs
    pa, pb = np.load(os.path.join(a, "params.npz")), np.load(os.path.join(b, "params.npz"))
    assert pa.files == pb.files and all(np.array_equal(pa[k], pb[k]) for k in pa.files)


def test_tensorboard_events_read_back_with_the_logged_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a, _ = runs
    acc = EventAccumulator(os.path.join(a, "tensorboard"))
    acc.Reload()
    logged = [json.loads(ln) for ln in open(os.path.join(a, "metrics.jsonl"))]
    train_rows = [r for r in logged if "loss" in r]
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [10, 20, 30] == [r["step"] for r in train_rows]
    np.testing.assert_allclose([e.value for e in events], [r["loss"] for r in train_rows],
                               rtol=1e-6)
    assert {"accuracy", "lr", "grad_norm", "eval_accuracy"} <= set(acc.Tags()["scalars"])


def test_csv_has_one_row_per_log(runs):
    a, _ = runs
    lines = open(os.path.join(a, "metrics.csv")).read().splitlines()
    assert lines[0].startswith("step,epoch,examples,loss")
    assert [ln.split(",")[0] for ln in lines[1:]] == ["10", "20", "30", "30"]


def test_profile_steps_write_a_trace(runs):
    a, _ = runs
    traces = glob.glob(os.path.join(a, "profile", "plugins", "profile", "*", "*.xplane.pb"))
    assert traces and os.path.getsize(traces[0]) > 1000
    assert glob.glob(os.path.join(a, "profile", "plugins", "profile", "*",
                                  "perfetto_trace.json.gz"))


def test_plot_one_and_two_runs(runs, capsys):
    a, b = runs
    assert main(["plot", a]) == 0
    assert main(["plot", a, b]) == 0
    for png in (os.path.join(a, "metrics.png"),
                os.path.join(os.path.dirname(a), "compare-a-vs-b.png")):
        head = open(png, "rb").read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20_000
    assert main(["plot", os.path.dirname(a)]) == 2  # not a run directory
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_quiet_prints_only_the_summary(tmp_path, capsys):
    assert main(["train", *RUN, "--quiet"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("eval accuracy")


@pytest.mark.parametrize("text,needle", [
    ("model:\n  name: mlp\nbogus: 3\n", "unknown field(s) bogus"),
    ("model: [unclosed\n", "not valid YAML"),
    ("optimizer:\n  lr: fast\n", "--lr must be float"),
    ("lr: 0.1\n", "unknown field(s) lr"),  # flat names are the command line's
    ("- a list\n", "must hold a mapping"),
])
def test_bad_config_files_exit_2(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.processes  # starts dpax processes
def test_progress_bar_on_a_terminal_and_lines_without_one():
    cmd = [sys.executable, "-m", "dpax", "train", "--model", "mlp", "--devices", "2",
           "--steps", "30", "--log-every", "10"]
    leader, follower = pty.openpty()
    # A real terminal has a size; a bare pty reports 0 columns.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    p = subprocess.Popen(cmd, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=120) == 0
    screen = b"".join(chunks).decode(errors="replace")
    last_frame = screen.replace("\r\n", "\n").split("\r")[-1]
    assert "\r" in screen.replace("\r\n", "\n")  # redrawn in place
    assert "30/30" in last_frame and "step/s" in last_frame and "loss=" in last_frame
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "\r" not in piped.stdout
    assert [ln.split()[1] for ln in piped.stdout.splitlines() if ln.startswith("step ")] == \
        ["10/30", "20/30", "30/30", "30/30"]


def test_bench_refuses_an_unknown_workload(tmp_path):
    # The bench itself runs in test_readme (the README's bench command).
    assert main(["bench", "--workloads", "resnet"]) == 2
    assert main(["bench", "--workloads", "tiny", "--optimizer", "lion"]) == 2
    # No workload's batch splits over 3 devices: refused, not a run that times nothing.
    assert main(["bench", "--workloads", "tiny,mlp", "--devices", "1,3"]) == 2
    from dpax.bench.run import run_bench  # the Python API refuses it before timing anything
    with pytest.raises(DpaxError, match="divides no workload's batch"):
        run_bench(["tiny"], [3], out_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())
    # An --out that is a file: one line, exit 2 (was a FileExistsError, exit 1).
    afile = tmp_path / "afile"
    afile.write_text("kept")
    assert main(["bench", "--workloads", "tiny", "--devices", "1", "--out", str(afile)]) == 2
    with pytest.raises(DpaxError, match="is a file"):
        run_bench(["tiny"], [1], out_dir=str(afile))
    assert afile.read_text() == "kept"


def test_every_bench_optimizer_is_what_every_method_trains_with():
    import dataclasses

    from dpax.bench import OPTIMIZERS, WORKLOADS

    for name in OPTIMIZERS:
        w = dataclasses.replace(WORKLOADS["tiny"], optimizer=name)
        params = {"w": np.ones(3, np.float32)}
        tx = w.tx()
        updates, _ = tx.update({"w": np.ones(3, np.float32)}, tx.init(params), params)
        assert np.all(np.asarray(updates["w"]) < 0), name  # a descent step
    assert WORKLOADS["mlp"].optimizer == "adam"  # the default: what users train with
