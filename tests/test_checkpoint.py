"""Checkpoints: exact resume after kill -9 and SIGTERM, elastic resume on other
device counts, fallback past damaged checkpoints, eval and predict from one."""

import csv
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint
import pytest

import dpax
from conftest import max_diff
from dpax.cli import main

RUN = ["--model", "mlp", "--optimizer", "momentum", "--lr", "0.05", "--batch-size", "61",
       "--log-every", "5"]


def params(out):
    with np.load(os.path.join(out, "params.npz")) as p:
        return {k: p[k] for k in p.files}


def train_rows(out):
    """The steps logged with a loss, in metrics.jsonl and alike in metrics.csv."""
    rows = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r["step"] for r in rows if "loss" in r]
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["loss"]] == steps
    return steps


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
@pytest.mark.processes  # starts dpax processes
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


@pytest.mark.processes  # starts dpax processes
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


@pytest.mark.processes  # starts dpax processes
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


def flip_bytes(step_dir, count=200):
    """Flip `count` bytes in the middle of the step's largest file; its path."""
    files = [os.path.join(root, f) for root, _, names in os.walk(step_dir) for f in names]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.seek(os.path.getsize(largest) // 2)
        data = f.read(count)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))
    return os.path.relpath(largest, step_dir)


def warning_lines(err):
    return [ln for ln in err.splitlines() if "warning" in ln]


@pytest.mark.slow
def test_flipped_bytes_in_the_newest_step_are_never_evaluated_nor_trained_from(
        tmp_path, capsys):
    """Flipped bytes in the newest step's largest file: eval and resume fall back
    to the step before (its params exactly), each saying so in one line; the
    step named alone is refused; the resumed run saves it anew, intact."""
    flags = [*RUN, "--devices", "2", "--steps", "30", "--checkpoint-dir", str(tmp_path / "ck"),
             "--checkpoint-every", "10"]
    ck, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    assert main(["train", *flags, "--out", ref]) == 0
    step_20 = dpax.cli.job.load_checkpoint(f"{ck}/20").trainer.params
    assert main(["eval", "--checkpoint", f"{ck}/20", "--devices", "2"]) == 0
    eval_20 = capsys.readouterr().out.strip().splitlines()[-1]
    damaged = flip_bytes(f"{ck}/30")

    assert main(["eval", "--checkpoint", ck, "--devices", "2"]) == 0
    captured = capsys.readouterr()
    warned = warning_lines(captured.err)
    assert len(warned) == 1 and "step 30" in warned[0] and damaged in warned[0], captured.err
    assert warned[0].endswith("using step 20")
    assert captured.out.strip().splitlines()[-1] == eval_20  # step 20's numbers
    assert main(["eval", "--checkpoint", f"{ck}/30", "--devices", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step 30" in err and "is damaged" in err, err

    loaded = dpax.cli.job.load_checkpoint(ck)  # the Python API falls back alike
    assert max_diff(loaded.trainer.params, step_20) == 0.0
    with pytest.raises(dpax.DpaxError, match="step 30 .* is damaged"):
        dpax.cli.job.load_checkpoint(f"{ck}/30")
    capsys.readouterr()

    # Resumed with saves every 5 steps: Orbax saves only past its newest
    # step, so the damaged 30 is renamed out of its view at the first save, 25.
    more = [*flags, "--checkpoint-every", "5", "--keep", "5"]  # the later flags win
    out = str(tmp_path / "resumed")
    assert main(["train", *more, "--resume", "--out", out]) == 0
    captured = capsys.readouterr()
    warned = warning_lines(captured.err)
    assert len(warned) == 1 and "step 30" in warned[0], captured.err
    assert "resumed at step 20" in captured.out
    assert max_diff(params(out), params(ref)) == 0.0  # retrained 20 -> 30 exactly
    ckpt = dpax.training.checkpoint.Checkpointer(ck)
    assert ckpt.steps() == [10, 20, 25, 30] and ckpt.damage(30) is None  # saved anew
    assert sorted(os.listdir(ck)) == ["10", "20", "25", "30", "30.damaged"]
    kept = dpax.training.checksums.check(f"{ck}/30.damaged")  # kept as it was
    assert kept is not None and damaged in kept.text
    final = dpax.cli.outputs.flat_params(dpax.cli.job.load_checkpoint(ck).trainer.params)
    assert max_diff(final, params(ref)) == 0.0

    # The new 30 damaged too: set aside under a name of its own.
    flip_bytes(f"{ck}/30")
    assert main(["train", *more, "--resume", "--out", out]) == 0
    assert "resumed at step 25" in capsys.readouterr().out
    assert max_diff(params(out), params(ref)) == 0.0
    assert sorted(os.listdir(ck)) == ["10", "20", "25", "30", "30.damaged", "30.damaged.2"]


@pytest.mark.slow
def test_a_resume_from_an_older_step_sets_the_newer_ones_aside(tmp_path, capsys, monkeypatch):
    """`--resume ck/10` with the longer schedule while ck holds the old run's
    20 and 30: the new run's first save renames them out of Orbax's view
    (which saves only past its newest step), so its own 20 and its stop at
    a signal are saved; a later `--resume` continues the new run exactly."""
    flags = [*RUN, "--devices", "2", "--schedule", "warmup-cosine"]
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    saves = ["--checkpoint-dir", ck, "--checkpoint-every", "10"]
    assert main(["train", *flags, "--steps", "30", *saves, "--out", out]) == 0
    assert dpax.training.checkpoint.Checkpointer(ck).steps() == [10, 20, 30]
    old_30 = dpax.cli.job.load_checkpoint(ck).trainer.params
    ref = str(tmp_path / "ref")  # the new flags from step 10, uninterrupted
    shutil.copytree(f"{ck}/10", tmp_path / "copy" / "10")
    assert main(["train", *flags, "--steps", "40", "--resume", str(tmp_path / "copy" / "10"),
                 "--out", ref]) == 0
    save = dpax.training.hooks.Checkpoint.save

    def stop_after_20(self, step):  # a SIGUSR1 once step 20 is saved
        saved = save(self, step)
        if step == 20:
            os.kill(os.getpid(), signal.SIGUSR1)
        return saved

    monkeypatch.setattr(dpax.training.hooks.Checkpoint, "save", stop_after_20)
    capsys.readouterr()
    assert main(["train", *flags, "--steps", "40", *saves, "--resume", f"{ck}/10",
                 "--out", out]) == 4
    assert "checkpoint saved" in capsys.readouterr().err
    monkeypatch.undo()
    stopped = dpax.training.checkpoint.Checkpointer(ck).steps()
    assert stopped[:2] == [10, 20] and len(stopped) == 3 and stopped[2] > 20, stopped
    assert sorted(os.listdir(ck)) == sorted(["10", "20", str(stopped[2]), "20.superseded",
                                             "30.superseded"])
    assert dpax.training.checksums.check(f"{ck}/30.superseded") is None  # kept intact
    os.mkdir(tmp_path / "old")  # as the docs say, to read it
    os.rename(f"{ck}/30.superseded", tmp_path / "old" / "30")
    aside = dpax.cli.job.load_checkpoint(str(tmp_path / "old" / "30")).trainer.params
    assert max_diff(aside, old_30) == 0.0

    assert main(["train", *flags, "--steps", "40", *saves, "--resume", "--out", out]) == 0
    assert f"resumed at step {stopped[2]}" in capsys.readouterr().out
    assert max_diff(params(out), params(ref)) == 0.0  # the new run's, not the old 30's
    assert train_rows(out) == list(range(5, 41, 5))  # the old run's 15..30 dropped


@pytest.fixture(scope="module")
def steps_10_20_30(tmp_path_factory):
    """A checkpoint directory holding steps 10, 20 and 30 of one run."""
    ck = str(tmp_path_factory.mktemp("trained") / "ck")
    assert main(["train", *RUN, "--devices", "2", "--steps", "30", "--checkpoint-dir", ck,
                 "--checkpoint-every", "10", "--quiet"]) == 0
    return ck


def test_a_save_orbax_skips_is_an_error_not_a_checkpoint(steps_10_20_30, tmp_path):
    """Orbax writes nothing for a step at or before its newest: a Checkpointer
    that did not restore the newer steps says so, and keeps every step."""
    ck = str(tmp_path / "ck")
    shutil.copytree(steps_10_20_30, ck)
    loaded = dpax.cli.job.load_checkpoint(f"{ck}/10")
    ckpt = dpax.training.checkpoint.Checkpointer(ck)
    for step in (10, 15):  # 10 exists, but is not this Checkpointer's
        with pytest.raises(dpax.errors.RunFailed, match=f"step {step} was not saved: {ck} "
                           "holds step 30, newer, which this run did not resume from"):
            ckpt.save(step, loaded.trainer.state_dict(), None, loaded.meta)
    ckpt.close()
    assert sorted(os.listdir(ck)) == ["10", "20", "30"]


def test_a_failed_save_after_a_fallback_does_not_name_the_damaged_step(steps_10_20_30,
                                                                      tmp_path, monkeypatch):
    """A restore passed over the damaged 30; the next save fails before it
    starts (renaming 30 aside): the step it names as kept is 20, and no step
    was renamed or removed."""
    ck = str(tmp_path / "ck")
    shutil.copytree(steps_10_20_30, ck)
    flip_bytes(f"{ck}/30")
    loaded = dpax.cli.job.load_checkpoint(f"{ck}/10")
    ckpt = dpax.training.checkpoint.Checkpointer(ck)
    assert loaded.trainer.restore(ckpt)[0] == 20
    rename = os.rename

    def refused(src, dst):
        if os.path.basename(src) == "30":
            raise PermissionError(errno.EACCES, "Permission denied", src)
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(dpax.errors.RunFailed) as failed:
        ckpt.save(25, loaded.trainer.state_dict(), None, loaded.meta)
    assert str(failed.value) == (f"checkpoint failed: permission denied while saving step 25 "
                                 f"in {ck}; the newest complete checkpoint there is step 20")
    monkeypatch.undo()
    ckpt.close()
    assert sorted(os.listdir(ck)) == ["10", "20", "30"]


def test_an_intact_step_that_cannot_be_read_stops_the_read_and_is_kept(steps_10_20_30,
                                                                        tmp_path, monkeypatch):
    """Step 30 matches its checksums but its state cannot be read (memory,
    the file system): `load_checkpoint` of the directory and a restore stop
    with one RunFailed line; nothing falls back to 20, nothing is set aside,
    and once the read works again step 30 is read."""
    ck = str(tmp_path / "ck")
    shutil.copytree(steps_10_20_30, ck)
    read = orbax.checkpoint.CheckpointManager.restore

    def failing(self, step, args=None):
        if step == 30 and "state" in args:
            raise OSError(errno.EIO, "Input/output error")
        return read(self, step, args=args)

    monkeypatch.setattr(orbax.checkpoint.CheckpointManager, "restore", failing)
    expected = (f"checkpoint step 30 in {ck} could not be read (OSError: [Errno 5] "
                "Input/output error); its files match their checksums, so it was kept")
    with pytest.raises(dpax.errors.RunFailed) as failed:
        dpax.cli.job.load_checkpoint(ck)
    assert str(failed.value).endswith(expected)
    monkeypatch.undo()
    loaded = dpax.cli.job.load_checkpoint(f"{ck}/10")
    ckpt = dpax.training.checkpoint.Checkpointer(ck)
    monkeypatch.setattr(orbax.checkpoint.CheckpointManager, "restore", failing)
    with pytest.raises(dpax.errors.RunFailed, match="step 30 .* could not be read"):
        loaded.trainer.restore(ckpt)
    monkeypatch.undo()  # the failed restore left that Trainer without a state
    loaded = dpax.cli.job.load_checkpoint(f"{ck}/10")
    assert loaded.trainer.restore(ckpt)[0] == 30
    ckpt.save(31, loaded.trainer.state_dict(), None, loaded.meta)
    ckpt.close()
    assert sorted(os.listdir(ck)) == ["20", "30", "31"]  # the newest 3 (--keep): none aside


def test_a_step_whose_files_cannot_be_checked_is_not_called_damaged(steps_10_20_30,
                                                                      monkeypatch):
    """A file the check cannot open (permissions, the file system) says so
    in one RunFailed line; it is not damage, so no older step is taken."""
    def refused(step_dir, *args):
        raise PermissionError(errno.EACCES, "Permission denied", f"{step_dir}/state")

    monkeypatch.setattr(dpax.training.checksums, "check", refused)
    with pytest.raises(dpax.errors.RunFailed) as failed:
        dpax.training.checkpoint.Checkpointer(steps_10_20_30).newest_meta()
    assert str(failed.value) == (f"checkpoint step 30 in {steps_10_20_30} could not be "
                                 f"checked (PermissionError: [Errno 13] Permission denied: "
                                 f"'{steps_10_20_30}/30/state')")


def test_truncated_unlisted_and_all_damaged_steps(tmp_path, capsys):
    """A truncated file and a step without its checksums are damage too; the
    Python API raises `DpaxError` where the CLI exits 2, with one line."""
    flags = [*RUN, "--devices", "2", "--steps", "30", "--checkpoint-dir", str(tmp_path / "ck"),
             "--checkpoint-every", "10"]
    ck = str(tmp_path / "ck")
    assert main(["train", *flags]) == 0
    step_10 = dpax.cli.job.load_checkpoint(f"{ck}/10").trainer.params
    trainer = dpax.cli.job.load_checkpoint(f"{ck}/30").trainer  # holds step 30's params
    state = os.path.join(ck, "30", "state", "manifest.ocdbt")
    os.truncate(state, os.path.getsize(state) - 1)
    os.remove(os.path.join(ck, "20", dpax.training.checksums.MANIFEST))
    capsys.readouterr()

    step, _ = trainer.restore(dpax.training.checkpoint.Checkpointer(ck))
    warned = warning_lines(capsys.readouterr().err)
    assert step == 10 and max_diff(trainer.params, step_10) == 0.0
    assert len(warned) == 1 and "steps 30 (state/manifest.ocdbt changed size" in warned[0]
    assert "20 (it has no dpax_checksums.json" in warned[0]
    with pytest.raises(dpax.DpaxError, match="step 20 .*no dpax_checksums.json.*trust"):
        dpax.cli.job.load_checkpoint(f"{ck}/20")

    flip_bytes(f"{ck}/10")
    assert main(["train", *flags, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no intact checkpoint" in err, err
    assert "Traceback" not in err
    with pytest.raises(dpax.DpaxError, match="no intact checkpoint"):
        trainer.restore(dpax.training.checkpoint.Checkpointer(ck))


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
    # A checkpoint past the run's steps: refused before anything is written
    # (it trained nothing, rewrote params.npz, then failed at its last save, exit 1).
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", *RUN, "--steps", "6", "--checkpoint-dir", ck, "--resume",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "at step 10, past the 6 steps" in err
    assert not out.exists()


def test_eval_and_predict_from_a_checkpoint(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    # The MLP: what a checkpoint restores does not depend on the model, and
    # its train, eval and predict steps compile faster than the CNN's.
    assert main(["train", "--model", "mlp", "--steps", "40", "--log-every", "20", "--devices",
                 "8", "--checkpoint-dir", ck]) == 0
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
