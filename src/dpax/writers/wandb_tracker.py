"""Weights & Biases: the run's config, every logged row at its step, its files
as artifacts. Offline (files under OUT/wandb, `wandb sync` uploads them later)
unless the user has set W&B up: WANDB_MODE or WANDB_API_KEY in the
environment, or a `wandb login`."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

from dpax.writers import MetricWriter
from dpax.writers.trackers import Logged, metrics, run_name


def offline() -> bool:
    """Whether W&B logs to local files only: unless the user has set W&B up
    (WANDB_MODE or WANDB_API_KEY in the environment, or a `wandb login`)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode in ("offline", "dryrun")
    if os.environ.get("WANDB_API_KEY"):
        return False
    netrc = os.path.expanduser("~/.netrc")
    return not (os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read())


def offline_history(wandb_dir: str, run_id: str) -> list[tuple[int, dict]]:
    """The (step, metrics) rows the offline files of run `run_id` hold, read by
    W&B's own reader (`wandb leet inspect`). W&B flushes a run's file every
    15 s and when it finishes: a killed run's file holds a prefix of its rows."""
    rows = []
    for run_dir in sorted(glob.glob(os.path.join(wandb_dir, f"offline-run-*-{run_id}"))):
        text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                               run_dir], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("type") == "history":
                item = record["history"]["item"]
                rows.append((record["history"]["step"]["num"],
                             {k: v for k, v in item.items() if not k.startswith("_")}))
    return rows


class WandbTracker(MetricWriter):
    """One W&B run per dpax run; a resumed dpax run continues it under the
    same id (`previous`: what `state()` returned when it started)."""

    def __init__(self, out: str, config: dict, previous: dict | None):
        import wandb

        local = offline()
        held = []
        if previous and local:  # before this run adds its own (empty) file
            held = offline_history(os.path.join(out, "wandb"), previous["id"])
        settings = wandb.Settings(
            mode="offline" if local else None,
            console="off",  # dpax draws its own progress; W&B must not wrap stdout
            silent=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dpax"),
                               name=run_name(out), id=previous and previous["id"],
                               dir=os.path.abspath(out), config=config, resume="allow",
                               settings=settings)
        if held:
            self._logged = Logged((step, key) for step, row in held for key in row)
        elif previous and not local and self._run.step > 0:
            # Online, W&B knows the next step; it keeps the first value of a step.
            self._logged = Logged(through=self._run.step - 1)
        else:
            self._logged = Logged()

    @property
    def directory(self) -> str:
        """The W&B run's own directory (what `wandb sync` takes)."""
        return os.path.dirname(self._run.dir)

    def state(self) -> dict:
        return {"id": self._run.id}

    def where(self) -> str:
        if self._run.settings.mode in ("offline", "dryrun"):
            return (f"W&B offline run {self._run.id} in {self.directory} "
                    f"(upload: wandb sync {self.directory})")
        return f"W&B run {self._run.url or self._run.id}"

    def write(self, step: int, row: dict) -> None:
        values = self._logged.fresh(step, metrics(row))
        if values:
            self._run.log(values, step=step)  # W&B writes NaN and infinity as such

    def artifact(self, path: str) -> None:
        import wandb

        stem = re.sub(r"[^A-Za-z0-9_.-]", "-", os.path.splitext(os.path.basename(path))[0])
        art = wandb.Artifact(f"run-{self._run.id}-{stem}", type="dpax-run-file")
        art.add_file(path)
        self._run.log_artifact(art)

    def finish(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)

    def close(self) -> None:
        self.finish(False)
