"""Checkpoints on Orbax: training state, Grain data position and run metadata
in one atomic step directory; async saves; exact, elastic, corruption-aware resume.

A step directory holds three items: `state` (one logical copy of the
TrainState, so it restores onto any device count), `data` (the Grain iterator's
position, one file per process) and `meta` (the resolved run config and what is
needed to rebuild the model). Orbax writes into a temporary directory and
renames it when complete, so a half-written save is never taken for a good one.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from dpax.errors import DpaxError


class Checkpointer:
    """Saves every `every` steps, keeps the newest `keep`; restores the newest
    readable one.

    Args:
      directory: where step directories go (created if missing).
      every: steps between saves; 0 saves only when asked (end of run, preemption).
      keep: how many step directories to keep.
    """

    def __init__(self, directory: str, every: int = 0, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.every = every
        self._last: int | None = None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def due(self, step: int) -> bool:
        """Whether a multiple of `every` was reached since the last call (with
        several steps per call the state exists only at call boundaries)."""
        last = step - 1 if self._last is None else self._last
        self._last = step
        return bool(self.every) and step // self.every > last // self.every

    def save(self, step: int, state: dict, data: Any, meta: dict) -> None:
        """Start an async save. Returns once the state is copied off the devices,
        so the next (donating) step may run; the files are written in the background."""
        if step in self.manager.all_steps():
            return
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data)
        self.manager.save(step, args=ocp.args.Composite(**args))

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def _saved_processes(self, step: int) -> int | None:
        data_dir = os.path.join(self.directory, str(step), "data")
        names = os.listdir(data_dir) if os.path.isdir(data_dir) else []
        counts = {n.split("-of-")[1].split(".")[0] for n in names if "-of-" in n}
        return int(counts.pop()) if len(counts) == 1 else None

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta

    def restore(self, template: dict, data: Any, step: int | None = None,
                warn=None) -> tuple[int, dict, dict]:
        """Restore `step`, or the newest readable step, falling back past
        unreadable ones with a one-line warning each.

        Returns:
          (step, state dict, meta).
        """
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        if not candidates:
            raise DpaxError(f"no checkpoint in {self.directory}; train without --resume first")
        for s in candidates:
            args = {"state": ocp.args.StandardRestore(template),
                    "meta": ocp.args.JsonRestore()}
            # The data position is saved per process; with another process count
            # the caller rebuilds it from the step (batches depend on the step only).
            if data is not None and self._saved_processes(s) == jax.process_count():
                args["data"] = grain.checkpoint.CheckpointRestore(data)
            try:
                restored = self.manager.restore(s, args=ocp.args.Composite(**args))
            except Exception as e:  # Orbax raises many types for damaged files
                reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
                print(f"dpax: warning: checkpoint step {s} in {self.directory} is unreadable "
                      f"({type(e).__name__}: {reason}); trying an older one",
                      file=warn or sys.stderr, flush=True)
                continue
            meta = dict(restored.meta, data_restored="data" in args)
            return s, dict(restored.state), meta
        raise DpaxError(f"no readable checkpoint in {self.directory} (tried steps "
                        f"{', '.join(map(str, candidates))}); they are damaged")


def locate(path: str) -> tuple[str, int | None]:
    """A checkpoint directory, or one of its step directories -> (directory, step)."""
    path = os.path.abspath(path.rstrip("/"))
    if not os.path.isdir(path):
        raise DpaxError(f"checkpoint path {path} does not exist")
    base = os.path.basename(path)
    if base.isdigit() and os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(base)
    return path, None
