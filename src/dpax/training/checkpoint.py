"""Checkpoints on Orbax: training state, Grain data position and run metadata
in one atomic step directory; async saves; exact, elastic, corruption-aware resume.

A step directory holds three items: `state` (one logical copy of the
TrainState, so it restores onto any device count), `data` (the Grain iterator's
position, one file per process) and `meta` (the resolved run config and what is
needed to rebuild the model). Orbax writes into a temporary directory and
renames it when complete, so a half-written save is never taken for a good one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dpax import config as cfg
from dpax.errors import DpaxError, RunFailed
from dpax.parallel import watchdog

LATEST, AUTO = "latest", "auto"  # --resume alone; --resume auto


@dataclasses.dataclass
class CheckpointConfig:
    """Where a run's checkpoints go, how often, and which one it resumes from."""

    dir: str | None = cfg.field(None, "directory for Orbax checkpoints", how=True,
                                flag="checkpoint_dir")
    every: int = cfg.field(0, "steps between checkpoints (0: only at the end)", how=True,
                           flag="checkpoint_every")
    every_minutes: float | None = cfg.field(
        None, "also a checkpoint once this many minutes passed since the last (checked at "
        "log steps; every process saves at the same step)", how=True,
        flag="checkpoint_every_minutes")
    keep: int = cfg.field(3, "checkpoints to keep", how=True)
    resume: str | None = cfg.field(
        None, "resume from the newest checkpoint in --checkpoint-dir, or from PATH; "
        "--resume auto: resume if --checkpoint-dir holds one, else start (for requeued and "
        "restarted jobs)", nargs="?", const=LATEST, how=True)

    def check(self) -> None:
        cfg.directory(self, "dir")
        cfg.whole(self, "every", low=0)
        cfg.number(self, "every_minutes", 0, low_open=True)
        cfg.whole(self, "keep")
        if (self.every or self.every_minutes) and self.dir is None:
            raise DpaxError("`checkpoint_every` and `checkpoint_every_minutes` need "
                            "`checkpoint_dir`")
        if self.resume in (LATEST, AUTO) and self.dir is None:
            raise DpaxError(f"`resume={self.resume}` needs `checkpoint_dir`")


class Checkpointer:
    """Saves when asked (`hooks.Checkpoint` asks every N steps), keeps the
    newest `keep`; restores the newest readable one.

    Args:
      directory: where step directories go (created if missing).
      keep: how many step directories to keep.
    """

    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        # Step directories are made before save() returns, so a directory that
        # cannot be made fails there, at once; made in the background, the
        # failure left Orbax's other threads waiting minutes for its signal.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: dict, data: Any, meta: dict) -> bool:
        """Start an async save. Returns once the state is copied off the devices,
        so the next (donating) step may run; the files are written in the background.
        A state that is not finite is not saved (False): it would push a good
        checkpoint out of the newest `keep`."""
        if step in self.manager.all_steps():
            return True
        if not all_finite(state, step):
            print(f"dpax: warning: step {step} was not checkpointed: its state is not "
                  "finite (a non-finite step applied, which skip_nonfinite=True skips, "
                  "or an update that overflowed); the checkpoints before it are kept",
                  file=sys.stderr, flush=True)
            return False
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data)
        # A save waits on the previous one and meets every process at a
        # barrier: a peer that stopped would hang it, so the watchdog times it.
        with self._failing_as(f"saving step {step}"), watchdog.waiting(step):
            self.manager.save(step, args=ocp.args.Composite(**args))
        return True

    def close(self) -> None:
        """Wait until every started save is on disk (a background write that
        failed raises here), then release the manager."""
        with self._failing_as("finishing the last save"), watchdog.waiting():
            self.manager.wait_until_finished()
        self.manager.close()

    @contextlib.contextmanager
    def _failing_as(self, what: str):
        try:
            yield
        except Exception as e:  # Orbax and the filesystem raise many types
            raise RunFailed(f"checkpoint failed ({what} in {self.directory}: "
                            f"{type(e).__name__}: {_first_line(e)})") from None

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

    def restore(self, template: dict, data: Any, step: int | None = None, warn=None,
                check: Callable[[dict], None] | None = None,
                before_read: Callable[[], None] | None = None) -> tuple[int, dict, dict]:
        """Restore `step`, or the newest readable step, falling back past
        unreadable ones with a one-line warning each.

        Args:
          template: the state's {path: ShapeDtypeStruct}; a checkpoint whose
            state has other paths or shapes was saved for another model or data,
            which is a `DpaxError`, not damage.
          check: called with the checkpoint's meta before its state is read; it
            raises to refuse (e.g. a resume that changes what is trained).
          before_read: called once the checkpoint is accepted, just before its
            state is read (e.g. to free the state it replaces).

        Returns:
          (step, state dict, meta).
        """
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        if not candidates:
            raise DpaxError(f"no checkpoint in {self.directory}; train without `resume` first")
        for s in candidates:
            try:
                meta = self.read_meta(s)
                saved = self._saved_shapes(s)
            except Exception as e:  # Orbax raises many types for damaged files
                self._unreadable(s, e, warn)
                continue
            if check is not None:
                check(meta)
            mismatch = _mismatch(saved, template)
            if mismatch:
                raise DpaxError(f"checkpoint step {s} in {self.directory} holds {mismatch}: "
                                "it was saved for another model or data")
            args = {"state": ocp.args.StandardRestore(template)}
            # The data position is saved per process; with another process count
            # the caller rebuilds it from the step (batches depend on the step only).
            if data is not None and self._saved_processes(s) == jax.process_count():
                args["data"] = grain.checkpoint.CheckpointRestore(data)
            if before_read is not None:
                before_read()
            try:
                restored = self.manager.restore(s, args=ocp.args.Composite(**args))
            except Exception as e:
                self._unreadable(s, e, warn)
                continue
            return s, dict(restored.state), dict(meta, data_restored="data" in args)
        raise DpaxError(f"no readable checkpoint in {self.directory} (tried steps "
                        f"{', '.join(map(str, candidates))}); their files are damaged")

    def _unreadable(self, step: int, e: Exception, warn) -> None:
        print(f"dpax: warning: checkpoint step {step} in {self.directory} is unreadable "
              f"({type(e).__name__}: {_first_line(e)[:120]}); trying an older one",
              file=warn or sys.stderr, flush=True)

    def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """{path: shape} of a step's saved state, from its metadata alone."""
        path = self.manager.directory / str(step) / "state"
        saved = ocp.StandardCheckpointHandler().metadata(path)
        return {k: tuple(v.shape) for k, v in saved.items()}


@jax.jit
def _finite(arrays: list) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(a).all() for a in arrays]))


def all_finite(state: dict, step: int | None = None) -> bool:
    """Whether every floating-point array of a state dict is finite: one
    reduction on the devices for device arrays (every process gets the same
    answer, so all of them save or none), numpy for host ones (pmap's copy).

    Reading the answer waits on every process: the state may be split over
    them (`state_dict` gathers only a padded split leaf, just before).
    A peer that stopped hangs it, so the watchdog times that read; the
    compile (the first save's only) stays outside the timer."""
    floats = [v for v in state.values() if jnp.issubdtype(v.dtype, jnp.inexact)]
    on_device = [v for v in floats if isinstance(v, jax.Array)]
    on_host = [v for v in floats if not isinstance(v, jax.Array)]
    if not all(np.isfinite(v).all() for v in on_host):
        return False
    if not on_device:
        return True
    check = _finite.lower(on_device).compile()  # cached by JAX after the first save
    with watchdog.waiting(step):
        return bool(check(on_device))


def _mismatch(saved: dict[str, tuple], template: dict) -> str | None:
    """What differs between a saved state's shapes and the template's, or None."""
    missing = sorted(set(template) - set(saved))
    if missing:
        return f"no {missing[0]} (this run's model has it)"
    for key, like in template.items():
        if tuple(saved[key]) != tuple(like.shape):
            return f"{key} of shape {tuple(saved[key])}, this run's model has {tuple(like.shape)}"
    return None


def locate(path: str) -> tuple[str, int | None]:
    """A checkpoint directory, or one of its step directories -> (directory, step)."""
    path = os.path.abspath(path.rstrip("/"))
    if os.path.exists(path) and not os.path.isdir(path):
        raise DpaxError(f"checkpoint path {path} is a file; give a checkpoint directory "
                        "or one of its step directories")
    if not os.path.isdir(path):
        raise DpaxError(f"checkpoint path {path} does not exist")
    base = os.path.basename(path)
    if base.isdigit() and os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(base)
    return path, None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else ""
