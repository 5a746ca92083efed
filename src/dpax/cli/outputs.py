"""What a run leaves in `--out` and shows on the terminal: its config, the
directory policy (checked before any work starts), the metric writers, and
files written atomically (a crash leaves the old file or the new one, never
half of one)."""

from __future__ import annotations

import csv
import dataclasses
import glob
import io
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from dpax import __version__
from dpax import config as cfg
from dpax.errors import DpaxError
from dpax.writers import MultiWriter, trackers
from dpax.writers.console import console_writer
from dpax.writers.csv_file import CsvWriter
from dpax.writers.jsonl import JsonlWriter, read_rows

# What `dpax train --out DIR` writes; a directory holding any of them holds a run.
RUN_FILES = ("config.yaml", "run.json", "tokenizer.json", "metrics.jsonl", "metrics.csv",
             "params.npz", "metrics.png", "tensorboard", "profile",
             # --tracker: which tracker runs it feeds, MLflow's local store, W&B's files
             "trackers.json", "mlflow.db", "mlartifacts", "wandb")
# A failure's details (`dpax.cli.failures`): `--overwrite` removes them, but
# alone they are not a run (an attempt that failed before writing one).
ERROR_LOGS = ("error.log", "error-rank*.log")


def writable_dir(path: str, what: str) -> bool:
    """Make sure `path` is a directory this process can write, creating it if
    needed; returns whether it was created (so a run that stops before writing
    anything can remove it again)."""
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise DpaxError(f"cannot write `{what}={path}`: {e.strerror or e}; "
                        "give a writable directory") from None
    probe(path, f"`{what}={path}`")
    return created


def probe(directory: str, what: str) -> None:
    """Check that a file can be made in `directory` (permissions, a read-only
    or immutable file system), for `what` the message names."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dpax-probe-"):
            pass
    except OSError as e:
        raise DpaxError(f"cannot write {what}: {e.strerror or e}; give a writable "
                        "directory") from None


def existing_parent(path: str, what: str) -> str:
    """The directory `path` goes in; a `DpaxError` if it is missing or a file."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise DpaxError(f"`{what}={path}`: {parent} is a file, not a directory")
    if not os.path.isdir(parent):
        raise DpaxError(f"`{what}={path}`: directory {parent} does not exist; create it first")
    return parent


def writable_file(path: str, what: str, suffixes: tuple[str, ...]) -> None:
    """Check that a file can be written at `path` before the work that makes it."""
    if not path or not path.endswith(suffixes) or os.path.isdir(path):
        raise DpaxError(f"`{what}={path}` must be a file path ending in "
                        f"{' or '.join(suffixes)}")
    probe(existing_parent(path, what), f"`{what}={path}`")


def check_dirs(out: OutputConfig, checkpoint, writer_process: bool) -> list[str]:
    """Refuse an `out` that holds another run (unless overwriting or resuming)
    and make sure every output directory can be written; returns the
    directories this made. `checkpoint`: the run's `CheckpointConfig`."""
    created = []
    if out.out is not None and writer_process:
        refuse_another_run(out, checkpoint)
        if writable_dir(out.out, "out"):
            created.append(out.out)
    if checkpoint.dir is not None and writable_dir(checkpoint.dir, "checkpoint_dir"):
        created.append(checkpoint.dir)
    return created


def refuse_another_run(out: OutputConfig, checkpoint) -> None:
    """Refuse an `out` that holds another run, unless overwriting or resuming."""
    if out.out is not None and holds_run(out.out) and not out.overwrite \
            and checkpoint.resume is None:
        kept = ""
        if checkpoint.dir is not None and holds_checkpoints(checkpoint.dir):
            kept = (f" (with an empty `checkpoint_dir`: {checkpoint.dir} holds checkpoints, "
                    "which `overwrite` keeps)")
        raise DpaxError(f"`out={out.out}` already holds a run; give a new `out`, "
                        f"`overwrite=True` to replace it{kept}, or `resume` to continue it")


def holds_checkpoints(path: str) -> bool:
    """Whether `path` holds step directories (Orbax names them by their step)."""
    return os.path.isdir(path) and any(name.isdigit() for name in os.listdir(path))


def holds_run(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                       for f in RUN_FILES)


def clear_run(path: str) -> None:
    """Remove a previous run's files from `path` (`--overwrite`); anything else stays."""
    logs = [os.path.basename(p) for pattern in ERROR_LOGS
            for p in glob.glob(os.path.join(path, pattern))]
    for name in (*RUN_FILES, *logs):
        target = os.path.join(path, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.remove(target)


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    """One host array per parameter path, e.g. `conv1/kernel` or `layers/0/bias`."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(params))
    return {"/".join(map(str, k)): np.asarray(v) for k, v in flat.items()}


def summary_line(ev: dict, steps: int | None = None, speed: float | None = None) -> str:
    """A run's (or a checkpoint's) eval metrics in one line."""
    parts = []
    if "accuracy" in ev:
        parts.append(f"eval accuracy {ev['accuracy']:.3f}")
    parts.append(f"eval loss {ev['loss']:.4g}")
    if "bpb" in ev:
        parts.append(f"bits/byte {ev['bpb']:.3f}  perplexity {ev['perplexity']:.3g}")
    if steps is not None:
        parts.append(f"steps {steps}")
    if speed is not None:
        parts.append(f"{speed:.1f} steps/s")
    return "  ".join(parts)


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """`arrays` in a .npz any numpy reads: bf16 ones (`--param-dtype bf16`) as
    float32, which holds every bf16 value exactly."""
    arrays = {k: np.asarray(a, np.float32) if np.asarray(a).dtype == jnp.bfloat16 else a
              for k, a in arrays.items()}
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def save_run_info(out: str, devices: int, mfu_peak=None, compile_cache: str | None = None,
                  replica_groups: int = 1) -> None:
    """`run.json`: what ran where (dpax, JAX, devices, processes, hybrid
    sharding's groups, the compilation cache) and, for a language model, the
    peak FLOP/s its MFU divides by and where it comes from."""
    info = {"dpax": __version__, "jax": jax.__version__,
            "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind,
            "devices": devices, "processes": jax.process_count(),
            "replica_groups": replica_groups, "compile_cache": compile_cache}
    if mfu_peak is not None:
        info.update(mfu_peak_flops=mfu_peak.flops, mfu_peak_source=mfu_peak.source)
    save_text(os.path.join(out, "run.json"), json.dumps(info, indent=1) + "\n")


def save_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def keep_metrics_up_to(out: str, step: int) -> None:
    """Drop the log rows past a resumed step from `metrics.jsonl` and
    `metrics.csv`, so every step is logged once."""
    path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(path):
        save_text(path, "".join(json.dumps(r) + "\n" for r in read_rows(path)
                                if r["step"] <= step))
    path = os.path.join(out, "metrics.csv")
    if os.path.exists(path):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        text = io.StringIO()
        csv.writer(text).writerows(rows[:1] + [r for r in rows[1:] if int(r[0]) <= step])
        save_text(path, text.getvalue())


def check_trackers(spec: str | None, out: str | None) -> None:
    """Refuse, before any work, a tracker that could not open its store: its
    library, or what the store it names needs, is not installed (a tracker
    opens after the run's first files are written, and a missing module then
    ends the run in a traceback). `out`: the run directory (MLflow's default
    store is in it)."""
    for kind, arg in trackers.parse(spec):
        if kind == "mlflow":
            from dpax.writers.mlflow_tracker import check_store

            check_store(arg, out)
        else:
            trackers.require(["wandb"], "`tracker=wandb`", "wandb")


def open_trackers(spec: str, out: str, config: dict, continue_run: bool) -> list:
    """The trackers `spec` names, logging for the run in `out`. `continue_run`:
    log into the tracker runs `out` started before (a resumed run), first the
    rows of `out/metrics.jsonl` they lack. Which tracker runs those are is kept in
    `out/trackers.json`."""
    state_path = os.path.join(out, trackers.STATE_FILE)
    state = trackers.read_state(state_path) if continue_run else {}
    opened = []
    for kind, arg in trackers.parse(spec):
        if kind == "mlflow":
            from dpax.writers.mlflow_tracker import MlflowTracker

            tracker = MlflowTracker(arg, out, config, state.get("mlflow"))
        else:
            from dpax.writers.wandb_tracker import WandbTracker

            tracker = WandbTracker(out, config, state.get("wandb"))
        state[kind] = tracker.state()
        trackers.save_state(state_path, state)
        if continue_run:  # what a crash kept from it (W&B flushes every 15 s), from ours
            for step, row in logged_rows(os.path.join(out, "metrics.jsonl")):
                tracker.write(step, row)
        opened.append(tracker)
    return opened


def logged_rows(path: str) -> list[tuple[int, dict]]:
    """metrics.jsonl's rows as (step, row), its nulls (non-finite values) left out."""
    return [(r.pop("step"), {k: v for k, v in r.items() if v is not None})
            for r in read_rows(path)]


@dataclasses.dataclass
class OutputConfig:
    """Where a run's files go and what the terminal shows."""

    out: str | None = cfg.field(None, "run directory for metrics.jsonl and params.npz",
                                how=True)
    overwrite: bool = cfg.field(False, "replace the run already in --out (default: refuse)",
                                how=True)
    tensorboard: bool = cfg.field(
        False, "also write TensorBoard event files to --out/tensorboard", how=True)
    tracker: str | None = cfg.field(
        None, "experiment trackers, repeatable or comma-separated: mlflow (a SQLite store "
        "in --out), mlflow:URI, wandb (offline unless W&B is set up)", how=True,
        metavar="NAME[:URI]", repeat=True)
    profile_steps: str | None = cfg.field(
        None, "A:B: a JAX profiler trace of steps A..B into --out/profile (Perfetto/TensorBoard)",
        how=True)
    quiet: bool = cfg.field(False, "no progress output, only the summary line and errors",
                            how=True)
    verbose: bool = cfg.field(False, "plain progress lines even on a terminal, plus run "
                              "details", how=True)

    def check(self) -> None:
        cfg.directory(self, "out")
        if self.profile_steps is not None:
            self.profile_range()
            if self.out is None:
                raise DpaxError("`profile_steps` needs `out` for the trace")
        if self.tensorboard and self.out is None:
            raise DpaxError("`tensorboard` needs `out` for the event files")
        if self.tracker:
            if self.out is None:
                raise DpaxError("`tracker` needs `out`: it names the tracker run and "
                                "keeps which one a resumed run continues")
            check_trackers(self.tracker, self.out)
        if self.quiet and self.verbose:
            raise DpaxError("give `quiet` or `verbose`, not both")

    def profile_range(self) -> tuple[int, int]:
        """First and last step (1-based, inclusive) of --profile-steps A:B."""
        a, sep, b = (self.profile_steps or "").partition(":")
        if not (sep and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)):
            raise DpaxError(f"`profile_steps` must be A:B with 1 <= A <= B, e.g. 10:20; "
                            f"got {self.profile_steps!r}")
        return int(a), int(b)

    def writers(self, total: int, start: int, log, writer_process: bool,
                config: dict | None = None, resumed: bool = False) -> MultiWriter:
        """The run's metric writers: progress on `log` (None: none), and on
        process 0 the files in `out`, continued past step `start`, and the
        trackers (given the run's `config`; `resumed`: continue their runs)."""
        writers = []
        if self.out is not None and writer_process:
            keep_metrics_up_to(self.out, start)
            writers.append(JsonlWriter(os.path.join(self.out, "metrics.jsonl"),
                                       append=start > 0))
            writers.append(CsvWriter(os.path.join(self.out, "metrics.csv"), append=start > 0))
            if self.tensorboard:
                from dpax.writers.tensorboard import TensorBoardWriter  # tensorboardX: slow import

                writers.append(TensorBoardWriter(os.path.join(self.out, "tensorboard")))
            if self.tracker:
                opened = open_trackers(self.tracker, self.out, config or {}, resumed)
                writers.extend(opened)
                if log is not None and not self.quiet:
                    for tracker in opened:
                        print(f"tracking: {tracker.where()}", file=log, flush=True)
        if log is not None and not self.quiet:  # last: a progress bar is drawn when made
            writers.insert(0, console_writer(total, start, log, self.verbose))
        return MultiWriter(writers)
