"""Checkpoints on Orbax: training state, Grain data position and run metadata
in one atomic step directory; async saves; exact, elastic, corruption-aware resume.

A step directory holds three items: `state` (one logical copy of the
TrainState, so it restores onto any device count), `data` (the Grain iterator's
position, one file per process) and `meta` (the resolved run config and what is
needed to rebuild the model), and the checksums of their files
(`dpax.training.checksums`). Orbax writes into a temporary directory and
renames it when complete, so a half-written save is never taken for a good
one; the checksums are written just before that rename, and checked before
a step is read, so a step damaged since is never trained from or evaluated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from dpax import config as cfg
from dpax.errors import DpaxError, RunFailed, summary
from dpax.parallel import distributed, watchdog
from dpax.parallel.arrays import all_finite
from dpax.training import checksums

LATEST, AUTO = "latest", "auto"  # `resume` given alone; `resume="auto"`
# Orbax's barriers are named after it (`_restore_items` takes one by name).
_BARRIERS = "dpax"


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
        None, "resume from the newest checkpoint in `checkpoint_dir`, or from PATH; "
        "`resume=auto`: resume if `checkpoint_dir` holds one, else start (for requeued and "
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
            which = "`resume=auto`" if self.resume == AUTO else "`resume`"
            raise DpaxError(f"{which} resumes from the newest checkpoint in `checkpoint_dir`: "
                            "give `checkpoint_dir`, or `resume` a checkpoint's path")


class Checkpointer:
    """Saves when asked (`hooks.Checkpoint` asks every N steps), keeps the
    newest `keep`; restores the newest intact one.

    Args:
      directory: where step directories go (created if missing).
      keep: how many step directories to keep.
    """

    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._writing: int | None = None  # the step whose files are being written
        self._swept = False  # of the unfinished saves of earlier runs
        self._damage: dict[int, checksums.Damage | None] = {}  # steps checked so far
        self._ours: set[int] = set()  # steps this Checkpointer saved, or restored
        self._restored: int | None = None  # the step restored, until the next save
        self._passed: set[int] = set()  # the newer steps that restore passed over
        # Step directories are made before save() returns, so a directory that
        # cannot be made fails there, at once; made in the background, the
        # failure left Orbax's other threads waiting minutes for its signal.
        # The checksums are written by the primary process once every process's
        # files are, before Orbax renames the step into place: a step directory
        # without them was not committed by this code.
        # Process 0 lists the steps and every process takes its list (a
        # collective with several processes, none with one): listing their
        # own, a process that listed before another run committed a step and
        # one that listed after tried different steps in the checks they make
        # together, and disagreed on whether a save is past the newest step.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True,
            single_host_load_and_broadcast=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=_BARRIERS),
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False,
                                           post_finalization_callback=self._write_checksums))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: dict, data: Any, meta: dict) -> bool:
        """Start an async save. Returns once the state is copied off the devices,
        so the next (donating) step may run; the files are written in the background.

        The first save after `restore` renames the steps newer than the
        restored one out of Orbax's view (`30.damaged`, `30.superseded`),
        deleting none: Orbax saves only steps past its newest, and they are
        another trajectory's.

        Returns:
          True when the save started, or when this Checkpointer saved or
          restored `step` already (the periodic save of the last step); False
          when the state is not finite: it is not saved, as it would push a
          good checkpoint out of the newest `keep`.

        Raises:
          RunFailed: the save could not start, a previous save's background
            write failed, or the directory holds a newer step that this
            Checkpointer did not restore.
        """
        if step in self._ours and step in self.manager.all_steps():
            return True  # saved already (the periodic save of the last step)
        # Every process gets the same answer: all of them save, or none.
        if not all_finite(state, step):
            print(f"dpax: warning: step {step} was not checkpointed: its state is not "
                  "finite (a non-finite step applied, which skip_nonfinite=True skips, "
                  "or an update that overflowed); the checkpoints before it are kept",
                  file=sys.stderr, flush=True)
            return False
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data)
        # Orbax's save would wait for the previous one too; waited for here, a
        # failure of its write is told as that step's, and the checksums
        # callback never sees `_writing` change under it.
        self._wait()
        if not self._swept:
            self._remove_unfinished()
            self._swept = True
        # A save waits on the previous one and meets every process at a
        # barrier: a peer that stopped would hang it, so the watchdog times it.
        with self._failing(step), watchdog.waiting(step):
            if self._restored is not None:
                self._set_aside(self._restored)
            self._writing = step
            saved = self.manager.save(step, args=ocp.args.Composite(**args))
        if not saved:  # Orbax saves only past its newest step, and says so only thus
            self._writing = None
            raise RunFailed(f"checkpoint step {step} was not saved: {self.directory} holds "
                            f"step {self.manager.latest_step()}, newer, which this run did not "
                            "resume from; give another `checkpoint_dir`, or `resume` from it")
        self._ours.add(step)
        return True

    def _set_aside(self, restored: int) -> None:
        """Rename the steps newer than `restored` out of Orbax's view (it
        lists only digit names): `30.damaged` if the restore passed over it,
        else `30.superseded`. Process 0 renames; every process waits for it
        and then reloads its view, so that all save the same steps."""
        newer = [s for s in self.manager.all_steps() if s > restored]  # alike on every process
        if newer:
            error = None
            if jax.process_index() == 0:
                try:
                    for s in newer:
                        kind = "damaged" if s in self._passed else "superseded"
                        os.rename(os.path.join(self.directory, str(s)), self._aside(s, kind))
                except OSError as e:
                    error = e
            if distributed.any_process(error is not None):  # also the wait for process 0
                raise error or OSError(f"process 0 could not rename steps {newer} aside")
            self.manager.reload()
            for s in newer:  # a step saved anew under the name is another's
                self._damage.pop(s, None)
        self._restored = None

    def _aside(self, step: int, kind: str) -> str:
        """A free name for `step` set aside: `30.superseded`, else
        `30.superseded.2`, ... (a step saved anew may be set aside again)."""
        base = os.path.join(self.directory, f"{step}.{kind}")
        path, n = base, 1
        while os.path.lexists(path):
            n += 1
            path = f"{base}.{n}"
        return path

    def close(self) -> None:
        """Wait until every started save is on disk (a background write that
        failed raises here), then release the manager."""
        self._wait()
        self.manager.close()

    def _wait(self) -> None:
        with self._failing(self._writing), watchdog.waiting():
            self.manager.wait_until_finished()

    def _write_checksums(self) -> None:
        checksums.write(self._unfinished(self._writing))

    def _unfinished(self, step: int) -> str:
        """Where Orbax writes `step` until it is complete."""
        return os.path.join(self.directory, f"{step}{ocp.path.step.TMP_DIR_SUFFIX}")

    def _remove_unfinished(self) -> None:
        """Remove the temporary directories of saves that never completed (a
        run killed while saving): they are never read, and only take space.
        Done at this Checkpointer's first save, not when it is made: a reader
        (`dpax eval` while a run trains) must not remove a save in progress."""
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if name.endswith(ocp.path.step.TMP_DIR_SUFFIX):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    @contextlib.contextmanager
    def _failing(self, step: int | None):
        """Turn a failure of saving `step` into one RunFailed line that says
        what is kept; the step's unfinished directory is removed."""
        try:
            yield
        except Exception as e:  # Orbax and the filesystem raise many types
            if step is not None and jax.process_index() == 0:
                shutil.rmtree(self._unfinished(step), ignore_errors=True)
            newest = self.newest_complete()
            kept = ("it holds no complete checkpoint" if newest is None
                    else f"the newest complete checkpoint there is step {newest}")
            raise RunFailed(f"checkpoint failed: {_cause(e)} while saving step {step} in "
                            f"{self.directory}; {kept}") from None

    def newest_complete(self) -> int | None:
        """The newest step committed on disk and not found damaged, for a
        failure's message. Read from the disk by this process alone: the
        manager's list has a step from when its save starts, and a failure
        may have stopped this process's peers."""
        try:
            found = ocp.path.step.standard_name_format().find_all(self.directory)
            steps = [m.step for m in found if self._damage.get(m.step) is None]
        except Exception:  # the directory itself may be what failed
            steps = []
        return max(steps, default=None)

    def steps(self) -> list[int]:
        """The step directories in Orbax's view, oldest first: process 0's
        listing, the same on every process (broadcast as numpy integers)."""
        return sorted(int(s) for s in self.manager.all_steps())

    def _saved_processes(self, step: int) -> int | None:
        data_dir = os.path.join(self.directory, str(step), "data")
        names = os.listdir(data_dir) if os.path.isdir(data_dir) else []
        counts = {n.split("-of-")[1].split(".")[0] for n in names if "-of-" in n}
        return int(counts.pop()) if len(counts) == 1 else None

    def damage(self, step: int) -> checksums.Damage | None:
        """What is damaged in `step`'s files (None when they match their
        checksums). Every process checks a share and all agree on the answer,
        so every process reads the same step; checked once per Checkpointer."""
        if step not in self._damage:
            step_dir = os.path.join(self.directory, str(step))
            found, error = None, None
            try:
                found = checksums.check(step_dir, jax.process_index(), jax.process_count())
            except OSError as e:  # permissions, the file system: not damage
                error = e
            if distributed.any_process(error is not None):
                cause = summary(error, 160) if error is not None else "on another process"
                raise RunFailed(f"checkpoint step {step} in {self.directory} could not be "
                                f"checked ({cause})")
            rank = distributed.least(checksums.INTACT if found is None else found.rank)
            if rank == checksums.INTACT:
                found = None
            elif found is None or found.rank != rank:  # a peer found it
                found = checksums.damage(step_dir, rank)
            self._damage[step] = found
        return self._damage[step]

    def read_meta(self, step: int) -> dict:
        """The run metadata saved with `step`; a `DpaxError` if the step is damaged."""
        return self.newest_meta(step)[1]

    def newest_meta(self, step: int | None = None, warn=None) -> tuple[int, dict]:
        """(step, meta) of `step`, or of the newest intact step: newer damaged
        ones are named in one warning line. A `DpaxError` if `step` is
        damaged, or every step is."""
        fallback = _Fallback(self.directory, named=step is not None)
        for s in self._candidates(step):
            if self._intact(s, fallback):
                meta = self._read_on_all(s, self._restore_items, s,
                                         ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
                fallback.settle(s, warn)
                return s, meta
        raise fallback.exhausted()

    def restore(self, template: dict, data: Any, step: int | None = None, warn=None,
                check: Callable[[dict], None] | None = None,
                before_read: Callable[[], None] | None = None) -> tuple[int, dict, dict]:
        """Restore `step`, or the newest intact step, falling back past
        damaged ones (named in one warning line).

        Args:
          template: the state's {path: ShapeDtypeStruct}; a checkpoint whose
            state has other paths or shapes was saved for another model or data,
            which is a `DpaxError`, not damage.
          step: the step to restore; if it is damaged, a `DpaxError` (no fallback).
          warn: a text stream for the warning line (default: stderr).
          check: called with the checkpoint's meta before its state is read; it
            raises to refuse (e.g. a resume that changes what is trained).
          before_read: called once the checkpoint is accepted, just before its
            state is read (e.g. to free the state it replaces).

        Returns:
          (step, state dict, meta).
        """
        fallback = _Fallback(self.directory, named=step is not None)
        for s in self._candidates(step):
            if not self._intact(s, fallback):
                continue
            meta, saved = self._read_on_all(s, self._meta_and_shapes, s)
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
            restored = self._read_on_all(s, self._restore_items, s, ocp.args.Composite(**args))
            fallback.settle(s, warn)
            self._ours, self._restored = {s}, s
            self._passed = {skipped for skipped, _ in fallback.skipped}
            return s, dict(restored.state), dict(meta, data_restored="data" in args)
        raise fallback.exhausted()

    def _candidates(self, step: int | None) -> list[int]:
        """The steps to try, newest first: `step` alone when given."""
        steps = self.steps()
        if step is not None and step not in steps:
            held = ", ".join(map(str, steps)) or "none"
            raise DpaxError(f"no checkpoint step {step} in {self.directory} (it holds: "
                            f"{held})")
        if not steps:
            raise DpaxError(f"no checkpoint in {self.directory}")
        return [step] if step is not None else steps[::-1]

    def _intact(self, step: int, fallback: _Fallback) -> bool:
        """Whether `step` matches its checksums; if not, it is told to
        `fallback` (which raises when the step was named)."""
        found = self.damage(step)
        if found is not None:
            fallback.skip(step, found.text)
        return found is None

    def _read_on_all(self, step: int, read: Callable[..., Any], *args) -> Any:
        """`read(*args)`, or a `RunFailed` on every process when it raised on
        any: a step that matches its checksums is intact, so a failure to read
        it is the machine's (memory, the file system, a peer), not damage:
        the step is neither passed over nor set aside. Agreed, so that no
        process raises alone while its peers wait in a collective."""
        value, error = None, None
        try:
            value = read(*args)
        except Exception as e:  # Orbax, JAX and the file system raise many types
            error = e
        if distributed.any_process(error is not None):
            cause = summary(error, 160) if error is not None else "on another process"
            raise RunFailed(f"checkpoint step {step} in {self.directory} could not be read "
                            f"({cause}); its files match their checksums, so it was kept")
        return value

    def _meta_and_shapes(self, step: int) -> tuple[dict, dict[str, tuple[int, ...]]]:
        meta = self._restore_items(step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        return meta, self._saved_shapes(step)

    def _restore_items(self, step: int, args: ocp.args.Composite) -> ocp.args.Composite:
        """`manager.restore`. Orbax ends a restore with a barrier of every
        process, a collective, and raises before it: a process whose restore
        raised takes that barrier itself, or its next collective (the
        agreement on the failure) paired with its peers' barrier, and every
        later one with a different step's. (Orbax 0.12's order, which the
        two-process test of tests/test_multiprocess.py holds it to.)"""
        try:
            return self.manager.restore(step, args=args)
        except Exception:
            if jax.process_count() > 1:
                with watchdog.waiting():
                    ocp.multihost.sync_global_processes(ocp.multihost.unique_barrier_key(
                        "Checkpointer:restore", prefix=_BARRIERS))
            raise

    def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """{path: shape} of a step's saved state, from its metadata alone."""
        path = self.manager.directory / str(step) / "state"
        saved = ocp.StandardCheckpointHandler().metadata(path)
        return {k: tuple(v.shape) for k, v in saved.items()}


class _Fallback:
    """The steps a read passed over as damaged, told in one line once it
    settles on one; a named step is not passed over: it is an error."""

    def __init__(self, directory: str, named: bool):
        self.directory, self.named = directory, named
        self.skipped: list[tuple[int, str]] = []

    def skip(self, step: int, why: str) -> None:
        self.skipped.append((step, why))
        if self.named:
            raise DpaxError(f"checkpoint {self._damaged()}; {self._vouch()}give the "
                            f"directory {self.directory} to use its newest intact step")

    def settle(self, step: int, warn=None) -> None:
        if self.skipped and jax.process_index() == 0:
            print(f"dpax: warning: checkpoint {self._damaged()}; using step {step}",
                  file=warn or sys.stderr, flush=True)

    def exhausted(self) -> DpaxError:
        return DpaxError(f"no intact checkpoint: {self._damaged()}; {self._vouch()}restore "
                         "the directory from a copy, or train again")

    def _damaged(self) -> str:
        """e.g. `step 30 in DIR is damaged (state/x does not match its checksum)`."""
        if len(self.skipped) == 1:
            (step, why), = self.skipped
            return f"step {step} in {self.directory} is damaged ({why})"
        each = ", ".join(f"{step} ({why})" for step, why in self.skipped)
        return f"steps {each} in {self.directory} are damaged"

    def _vouch(self) -> str:
        """How to vouch for a step without checksums (an older dpax's, maybe):
        first, as it is the likely fix after an upgrade."""
        if not any(checksums.MANIFEST in why for _, why in self.skipped):
            return ""
        return ("a step you trust that has no checksums gets them from "
                "`dpax.training.checksums.write(STEP_DIR)`; else ")

def _cause(e: Exception) -> str:
    """A failed save's cause in words: the OS error's, where there is one
    (Orbax's writes report it as text, `[os_error_code='28']`)."""
    for err in _chain(e):
        code = getattr(err, "errno", None)
        if code is None:
            found = re.search(r"os_error_code='?(\d+)", str(err))
            code = int(found.group(1)) if found else None
        if code in errno.errorcode:
            return os.strerror(code).lower()
    return summary(e, 160)


def _chain(e: BaseException):
    """`e` and the exceptions it was raised from or during."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


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
