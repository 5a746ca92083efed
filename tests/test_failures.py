"""Failure paths: a run that cannot go on says so in one line, fast, and keeps
what it has; nonsense is refused; what a run writes can be read back."""

import io
import json
import math
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import max_diff
from dpax import data, models
from dpax.cli import main
from dpax.cli.exits import as_flags
from dpax.models import losses
from dpax.training import hooks
from dpax.writers.console import FALLBACK_COLUMNS, ProgressBar
from dpax.writers.jsonl import JsonlWriter

RUN = ["--model", "mlp", "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "50",
       "--devices", "2", "--log-every", "5", "--quiet"]


@pytest.mark.slow
def test_a_checkpoint_save_that_fails_is_one_line_fast_and_keeps_the_params(
        tmp_path, capsys, monkeypatch):
    ck, out = tmp_path / "ck", tmp_path / "run"
    after_step = hooks.Checkpoint.after_step

    def break_then_save(self, step):  # the directory turns into a file at step 10
        if step == 10:
            self.ckpt.manager.wait_until_finished()  # step 5 is on disk
            shutil.rmtree(ck)
            ck.write_text("not a directory any more")
        return after_step(self, step)

    monkeypatch.setattr(hooks.Checkpoint, "after_step", break_then_save)
    t0 = time.monotonic()
    code = main(["train", *RUN, "--steps", "30", "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "5", "--out", str(out)])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1 and took < 60, (code, took)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "checkpoint failed: not a directory while saving step 10" in err
    assert "it holds no complete checkpoint; the params of step 10 are in" in err
    with np.load(out / "params.npz") as p:
        assert all(np.all(np.isfinite(p[k])) for k in p.files)


def _file_sizes(step_dir) -> dict:
    return {os.path.relpath(os.path.join(root, f), step_dir): os.path.getsize(
        os.path.join(root, f)) for root, _, names in os.walk(step_dir) for f in names}


@pytest.mark.slow
@pytest.mark.processes  # starts dpax processes
def test_a_background_write_that_fails_names_its_own_step_and_what_is_kept(tmp_path, capsys):
    """Files capped below the state's largest array (RLIMIT_FSIZE: a write past
    it fails with EFBIG, as a full disk fails with ENOSPC): the resumed run's
    first save, step 15, fails in the background; the run stops at the next
    save, step 20, naming step 15 and the kept step 10, and leaves no
    unfinished directory; a resume from there is the uninterrupted run."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    flags = [*RUN, "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--keep", "2"]
    assert main(["train", *flags, "--steps", "10"]) == 0
    # Half the largest array, not half the largest file: how many files
    # Orbax's store writes a step's arrays into varies from save to save
    # (one at one step, three at another), so the largest file is no bound;
    # the file that holds the largest array (compressed by a few percent)
    # is still well above half of it.
    ds = data.digits()
    model = models.make_model("mlp", ds.input_shape, ds.n_out, 0)
    largest = max(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))

    # SIGXFSZ would kill the process; ignored, the write fails with EFBIG.
    capped = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, "
              "signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, "
              f"({largest // 2}, {largest // 2})); sys.argv[0] = 'dpax'; "
              "runpy.run_module('dpax', run_name='__main__')")
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")  # its entries can be larger
    p = subprocess.run([sys.executable, "-c", capped, "train", *flags, "--steps", "30",
                        "--resume"], capture_output=True, text=True, env=env)
    said = p.stderr.splitlines()  # Orbax's errors and tracebacks go to the details file
    assert p.returncode == 1 and len(said) == 1, p.stderr[-3000:]
    assert said[0].startswith("dpax: error: checkpoint failed: file too large while saving "
                              f"step 15 in {ck}; the newest complete checkpoint there is step "
                              "10;"), (said, {s: _file_sizes(ck / s) for s in os.listdir(ck)})
    details = said[0].rsplit("(details in ", 1)[1].rstrip(")")
    assert "Traceback" in open(details).read()
    os.remove(details)
    assert sorted(os.listdir(ck)) == ["10", "5"]  # 5 not pushed out; no 15.orbax-checkpoint-tmp

    killed = ck / "12.orbax-checkpoint-tmp"  # as a run killed while saving leaves one
    (killed / "state").mkdir(parents=True)
    assert main(["train", *flags, "--steps", "30", "--resume", "--out", str(out)]) == 0
    logged = [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl")]
    assert logged[0] == 15 and not killed.exists()  # resumed at step 10; swept at its save
    ref = tmp_path / "uninterrupted"
    assert main(["train", *RUN, "--steps", "30", "--out", str(ref)]) == 0
    with np.load(out / "params.npz") as a, np.load(ref / "params.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in b.files)


@pytest.mark.slow
def test_a_failure_dpax_did_not_foresee_says_what_it_kept(tmp_path, capsys, monkeypatch):
    """An error no dpax code expects (the disk under `out` failing at the
    step-10 log, before that step's checkpoint, say) is one line that names
    it, what was kept (the params of that step, the newest checkpoint) and
    the details file; the params are those of an uninterrupted run of 10 steps."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    on_log = hooks.Write.on_log

    def failing(self, step, row):
        if step == 10:
            raise OSError(5, "Input/output error")
        on_log(self, step, row)

    monkeypatch.setattr(hooks.Write, "on_log", failing)
    assert main(["train", *RUN, "--steps", "20", "--out", str(out), "--checkpoint-dir",
                 str(ck), "--checkpoint-every", "5"]) == 1
    assert capsys.readouterr().err == (
        "dpax: error: OSError: [Errno 5] Input/output error; the params of step 10 are in "
        f"{out}/params.npz; the newest checkpoint is step 5 in {ck} "
        f"(details in {out}/error.log)\n")
    assert "Traceback" in (out / "error.log").read_text()
    monkeypatch.setattr(hooks.Write, "on_log", on_log)
    ref = tmp_path / "ten"
    assert main(["train", *RUN, "--steps", "10", "--out", str(ref)]) == 0
    with np.load(out / "params.npz") as a, np.load(ref / "params.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in b.files)


@pytest.mark.slow
def test_a_run_whose_params_are_not_finite_does_not_end_in_success(tmp_path, capsys,
                                                                  monkeypatch):
    """Finite gradients, but the optimizer makes NaN params (a NaN momentum, as
    a custom optimizer could): the next steps' losses are NaN, too few to stop
    the run; it must not exit 0, nor write NaN params."""
    monkeypatch.setattr(dpax.training.optim, "_optimizer",
                        lambda *a, **k: optax.sgd(0.1, momentum=math.nan))
    out = tmp_path / "run"
    code = main(["train", *RUN, "--steps", "3", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "the params are not finite after step 3" in err, err
    assert len(err.strip().splitlines()) == 1 and not (out / "params.npz").exists()
    assert main(["train", *RUN, "--lr", "1e39", "--steps", "1"]) == 2  # inf in float32
    assert "--lr must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_diverging_run_without_skipping_writes_nothing_that_is_not_finite(tmp_path,
                                                                             capsys):
    """By default the diverging steps are applied: the run stops with exit 3,
    names `--skip-nonfinite` as the way to skip them, writes no params.npz, and
    checkpoints none of its states (a warning for each), so nothing it leaves
    holds a NaN."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    code = main(["train", *RUN, "--lr", "1e20", "--steps", "40", "--max-bad-steps", "5",
                 "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and "were applied (skip_nonfinite=False)" in err[-1], err
    assert "resume from the last checkpoint with --skip-nonfinite" in err[-1], err
    assert all("was not checkpointed" in line for line in err[:-1]) and len(err) > 1
    assert not (out / "params.npz").exists()
    assert not [d for d in os.listdir(ck) if d.isdigit()]


@pytest.mark.slow
def test_a_finished_run_can_be_extended_with_more_steps(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train", *RUN, "--steps", "20", "--checkpoint-dir", ck,
                 "--out", str(tmp_path / "a")]) == 0
    assert main(["train", *RUN, "--steps", "30", "--checkpoint-dir", ck, "--resume",
                 "--out", str(tmp_path / "a")]) == 0
    assert main(["train", *RUN, "--steps", "30", "--out", str(tmp_path / "ref")]) == 0
    a, ref = (np.load(tmp_path / d / "params.npz") for d in ("a", "ref"))
    assert all(np.array_equal(a[k], ref[k]) for k in ref.files)
    rows = [json.loads(ln) for ln in open(tmp_path / "a" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [5, 10, 15, 20, 25, 30]
    # What is trained may not change on resume.
    capsys.readouterr()
    assert main(["train", *RUN, "--steps", "40", "--lr", "0.2", "--checkpoint-dir", ck,
                 "--resume"]) == 2
    assert "cannot resume: --lr was 0.1" in capsys.readouterr().err
    # The guard may: a finite step is the same either way, and a run stopped
    # by a NaN step gets past it so.
    assert main(["train", *RUN, "--steps", "35", "--skip-nonfinite", "--checkpoint-dir", ck,
                 "--resume", "--out", str(tmp_path / "a")]) == 0


def test_a_details_file_too_large_to_write_keeps_the_failures_own_traceback(tmp_path,
                                                                            monkeypatch):
    """Where the whole details file cannot be written (a file size limit, a
    disk nearly full), the failure's own traceback still is, without the
    log records; where nothing can be, no path is given."""
    import errno

    from dpax.cli import failures

    log = failures.FailureLog(["train"])
    log.records.extend(["a library's record " * 50] * 40)
    log.run_dir = str(tmp_path)
    real_open = open

    def capped(limit):
        class Capped(io.StringIO):
            def __init__(self, path):
                super().__init__()
                self.path = path

            def __exit__(self, *exc):
                if exc[0] is None:
                    if len(self.getvalue()) > limit:
                        raise OSError(errno.EFBIG, "File too large")
                    with real_open(self.path, "w") as f:
                        f.write(self.getvalue())
                return False

        return lambda path, mode="r": Capped(path)

    try:
        raise RuntimeError("the failure")
    except RuntimeError as e:
        error = e
    monkeypatch.setattr(failures, "open", capped(5000), raising=False)
    path = log.write(error)
    text = open(path).read()
    assert "RuntimeError: the failure" in text and "Traceback" in text
    assert "(the log records did not fit)" in text and "a library's record" not in text
    monkeypatch.setattr(failures, "open", capped(10), raising=False)
    assert log.write(error) is None


def test_metrics_jsonl_is_strict_json(tmp_path):
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(str(path))
    w.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "hist": np.array([1.0, np.nan])})
    w.close()
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"step": 1, "loss": None, "grad_norm": None, "hist": [1.0, None]}


def test_a_terminal_of_zero_columns_still_gets_a_bar(monkeypatch):
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=None: os.terminal_size((0, 0)))
    stream = io.StringIO()
    bar = ProgressBar(30, 0, stream)
    for step in (10, 20, 30):
        bar.write(step, {"loss": 1.0, "epoch": step / 10})
    bar.close()
    last = stream.getvalue().split("\r")[-1].strip()
    assert "30/30" in last and "|" in last and len(last) <= FALLBACK_COLUMNS


@pytest.mark.parametrize("bad", ["sum", "mean"])
def test_check_names_the_model_or_the_loss_that_mixes_examples(bad):
    """A model that centres its input on the batch mixes examples (the model is
    to blame); a loss that returns a mean cannot be compared at all."""
    ds = data.digits()

    class Centered(models.Linear):
        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            return self.dense(x - x.mean(0))

    def mean_loss(model, batch):
        return losses.classification_loss(model, batch)[0].mean()

    result = dpax.check_equivalence(
        lambda: Centered(ds.input_shape, ds.n_out, rngs=nnx.Rngs(0)),
        losses.classification_loss if bad == "sum" else mean_loss, ds.x_train, ds.y_train,
        devices=2, steps=2)
    report = result.report()
    assert not result.equivalent and "inf" not in report
    assert result.cause == ("model-mixes" if bad == "sum" else "loss-mean"), report


def test_check_says_a_loss_of_another_shape_is_bad_input():
    """One loss per class per example is no mean over the batch: the check
    raises what `fit` raises (the CLI exits 2), not "averages per device"."""
    ds = data.digits()

    def per_class(model, batch):
        return jax.nn.log_softmax(model(batch["x"]))

    with pytest.raises(dpax.errors.NotPerExample, match=r"got \(\d+, 10\)"):
        dpax.check_equivalence(lambda: models.Linear(ds.input_shape, ds.n_out,
                                                     rngs=nnx.Rngs(0)),
                               per_class, ds.x_train, ds.y_train, devices=2, steps=1)


def _ce(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def _metrics_trainer(loss, n):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 6)).astype(np.float32), rng.integers(0, 3, 30)
    t = dpax.Trainer(nnx.Linear(6, 3, rngs=nnx.Rngs(0)), loss, optax.adam(0.01), devices=n)
    return t, lambda: t.fit(x, y, batch_size=22, until_step=2, log_every=10**9), (x, y)


@pytest.mark.parametrize("n", [1, 2])
def test_a_metric_that_is_a_batch_mean_is_refused_in_one_line(n):
    """A mean over the shard counted padded rows on one device (0.203 for
    an accuracy of 0.267) and was refused as mixing on two, naming dpax's line."""
    def accuracy_of_batch(model, batch):
        logits = model(batch["x"])
        return _ce(model, batch), {"acc": (logits.argmax(-1) == batch["y"]).mean()}

    t, fit, _ = _metrics_trainer(accuracy_of_batch, n)
    with pytest.raises(dpax.errors.NotPerExample, match=r"metric 'acc' must hold one value "
                                                        r"per example .* got \(\)") as e:
        fit()
    assert e.value.name == "metric acc" and "\n" not in str(e.value)
    assert t.step == 0


def test_no_metrics_and_nested_metrics_train_and_report():
    """`(losses, None)` is `(losses, {})`; nested metrics are named by their
    path. Both crashed inside dpax (a TypeError, an AttributeError)."""
    plain, fit, (x, y) = _metrics_trainer(_ce, 2)
    fit()
    for loss in (lambda m, b: (_ce(m, b), None),
                 lambda m, b: (_ce(m, b), {"parts": {"ce": _ce(m, b)}})):
        t, fit, _ = _metrics_trainer(loss, 2)
        fit()
        assert max_diff(plain.params, t.params) == 0.0
    row = t.evaluate(x, y, batch_size=22)
    assert row["parts/ce"] == pytest.approx(row["loss"], rel=1e-6)


@pytest.mark.parametrize("metrics,message", [
    (lambda m, b: {"a/b": _ce(m, b), "a": {"b": _ce(m, b)}}, r"name 'a/b' twice"),
    (lambda m, b: {"acc": None}, r"metric 'acc' must be an array .*got NoneType"),
    (lambda m, b: {"t": (_ce(m, b), _ce(m, b))}, r"metric 't' must be an array .*got tuple"),
    (lambda m, b: {"n": 3.0}, r"metric 'n' must be an array .*got float"),
])
def test_metrics_that_are_no_arrays_or_collide_are_named(metrics, message):
    """A reviewer's: a nested name colliding with a flat one kept one of
    them in silence; None read as a batch mean; a tuple was JAX's
    TracerArrayConversionError."""
    t, fit, _ = _metrics_trainer(lambda m, b: (_ce(m, b), metrics(m, b)), 2)
    with pytest.raises(dpax.DpaxError, match=message):
        fit()
    assert t.step == 0


def test_check_finds_values_not_finite_on_n_devices_only(monkeypatch):
    """Params NaN on N devices and finite on one are no match: `max` of a
    NaN kept the earlier 0.0, and the check said "equivalent". The default
    batch pads on 3 devices too (5N+3 = 18 split evenly)."""
    ds = data.digits()

    class ByShardRows(models.Linear):  # divides by (a device's rows - 6): by 0 on 3 devices
        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            return self.dense(x) / (x.shape[0] - 6)

    def check():
        return dpax.check_equivalence(
            lambda: ByShardRows(ds.input_shape, ds.n_out, rngs=nnx.Rngs(0)),
            losses.classification_loss, ds.x_train, ds.y_train, devices=3, steps=1)

    # Refused before training (`dpax.analysis.batch_size`); where the
    # analysis cannot read such a model, the check's run finds the NaN.
    assert check().cause == "batch-size"
    monkeypatch.setattr(dpax.analysis.refusals, "uses_rows_count", lambda *a, **k: None)
    result = check()
    assert (result.batch_size, result.cause) == (17, "nonfinite"), result.report()
    assert "NOT equivalent" in result.report()
    assert all(dpax.training.check.default_batch(n) % n for n in range(2, 9))


def test_check_with_batchnorm_sync_off_says_to_turn_it_back_on():
    ds = data.digits()

    class BNLinear(nnx.Module):
        def __init__(self, rngs):
            self.bn = nnx.BatchNorm(64, rngs=rngs)
            self.dense = nnx.Linear(64, ds.n_out, rngs=rngs)

        def __call__(self, x):
            return self.dense(self.bn(x.reshape(x.shape[0], -1)))

    result = dpax.check_equivalence(lambda: BNLinear(nnx.Rngs(0)), losses.classification_loss,
                                    ds.x_train, ds.y_train, devices=2, steps=2,
                                    sync_batchnorm=False)
    assert result.cause == "batchnorm-off"
    cli = as_flags(result.report())
    assert "synchronization is off (--no-sync-batchnorm)" in cli and "use nnx.BatchNorm" not in cli


def test_a_run_length_that_is_no_whole_number_or_already_reached_is_named():
    """A new user's: `epochs=1.5` and `until_step=2.0` were Grain's TypeError,
    and a second `fit(epochs=1)` returned [] in silence (epochs count from
    step 0)."""
    t, fit, (x, y) = _metrics_trainer(_ce, 2)
    for length in ({"epochs": 1.5}, {"until_step": 2.0}):
        with pytest.raises(dpax.DpaxError, match=r"must be a whole number >= 1, got 2?1?\.[05]"):
            t.fit(x, y, batch_size=8, **length)
    assert t.fit(x, y, batch_size=8, epochs=1, log_every=10**9) != []
    with pytest.warns(dpax.errors.DpaxWarning, match=r"at step 4, which `epochs=1` \(step 4; "
                                                     r"epochs count from step 0\) has reached"):
        assert t.fit(x, y, batch_size=8, epochs=1) == []
    assert t.step == 4


def test_regression_predict_gives_each_examples_outputs():
    """It reshaped a model's (B, 3) outputs to (B,): JAX's TypeError."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 4)).astype(np.float32)
    for outputs, shape in ((3, (7, 3)), (1, (7,))):
        model = nnx.Linear(4, outputs, rngs=nnx.Rngs(0))
        t = dpax.Trainer(model, dpax.regression_loss, optax.sgd(0.1), devices=2,
                         predict_fn=dpax.regression_predict)
        got = t.predict(x)
        assert got.shape == shape
        np.testing.assert_allclose(got, np.asarray(model(x)).reshape(shape), rtol=1e-6)
