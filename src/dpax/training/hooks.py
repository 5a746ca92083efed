"""The periodic host work of a training run, as `dpax.training.loop.Hook`s: each duty
is one small object with its own trigger (clu's `PeriodicAction` idea).

  TrackPosition   the data position checkpoints save: the last batch trained on
  Write           every log row to the writers; times the first log
  Evaluate        eval metrics added to the row every `every` steps
  Checkpoint      a save every `every` steps
  StopOnSignal    SIGTERM/SIGINT/SIGUSR1: save, then stop at a step boundary
  Profile         a JAX profiler trace of steps A..B
  LanguageModel   tokens/s, MFU, bits per byte and perplexity in the row
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import jax

from dpax.errors import Preempted
from dpax.parallel import watchdog
from dpax.parallel.distributed import any_process, from_process_0
from dpax.parallel.peak import Peak
from dpax.training.loop import Every, Hook


class TrackPosition(Hook):
    """Tells the data iterator (`pipeline.TrainedPosition`) how many of the
    batches it handed out were trained on; it reads ahead of the steps."""

    def __init__(self, data_iter, start: int):
        self.data_iter = data_iter
        self.step = start  # the last step trained

    def after_step(self, step):
        self.data_iter.trained(step - self.step)
        self.step = step


class Write(Hook):
    """Writes each row; remembers when the first log came (after compiling)."""

    def __init__(self, writer):
        self.writer = writer
        self.first: tuple[int, float] | None = None  # (step, time)

    def on_log(self, step, row):
        if self.first is None:
            self.first = (step, time.perf_counter())
        self.writer.write(step, row)

    def steady_speed(self, total: int) -> float | None:
        """Steps/s after the first log (whose interval holds the compilation)."""
        if self.first is None or total <= self.first[0]:
            return None
        step, t = self.first
        return (total - step) / (time.perf_counter() - t)


class Evaluate(Hook):
    """Adds `eval_<metric>` to a row every `every` steps before the end (the
    run evaluates once more when it ends); the loop logs a row there. With
    several steps per call, at the first call boundary at or past the multiple."""

    def __init__(self, trainer, data, every: int, total: int):
        self.trainer, self.data, self.every, self.total = trainer, data, every, total
        self.due, self.now = Every(every), False

    def on_start(self, step):
        self.due = Every(self.every, step)

    def wants_row(self, step):
        self.now = self.due(step) and step < self.total
        return self.now

    def on_log(self, step, row):
        if self.now:
            ev = self.trainer.evaluate(self.data)
            row.update({f"eval_{k}": v for k, v in ev.items() if k not in ("examples", "weight")})


class Checkpoint(Hook):
    """Saves the state, the data position and the run's meta every `every`
    steps, and once `every_minutes` passed since the last save. The clock is
    read at log steps, and process 0's reading decides for every process, so
    all of them save at the same step (a save is collective)."""

    def __init__(self, ckpt, trainer, data_iter, meta: dict, every: int,
                 every_minutes: float | None = None):
        self.ckpt, self.trainer, self.data_iter, self.meta = ckpt, trainer, data_iter, meta
        self.every = every
        self.every_s = None if every_minutes is None else 60.0 * every_minutes
        self.due = None
        self._last = time.monotonic()
        self._time_due = False

    def on_start(self, step):
        self.due = Every(self.every, step)
        self._last = time.monotonic()

    def on_log(self, step, row):
        if self.every_s is not None:
            self._time_due = from_process_0(time.monotonic() - self._last >= self.every_s)

    def save(self, step: int) -> bool:
        """Save `step`; False when its state is not finite, so nothing was saved."""
        # state_dict() only when saving: with pmap it copies the state to the host.
        saved = self.ckpt.save(step, self.trainer.state_dict(), self.data_iter, self.meta)
        self._last, self._time_due = time.monotonic(), False
        return saved

    def after_step(self, step):
        if self.due(step) or self._time_due:
            self.save(step)


class StopOnSignal(Hook):
    """First SIGTERM, SIGINT or SIGUSR1 (what `sbatch --signal=USR1@90` sends
    before a job's time limit): save a checkpoint (if any) and raise
    `Preempted` at the next step boundary, or, with several processes, at the
    next log step, where they agree to stop together (the save is collective).
    Second: the default action, at once. A context manager: the handlers are
    installed inside `with` only."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, checkpoint: Checkpoint | None):
        self.checkpoint = checkpoint
        self.signum = None
        self._old = {}
        self._agreed = False  # several processes: every one stops at this log step

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach only the main thread; nothing to catch here
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        # The default action comes back, so a second signal ends the process now.
        signal.signal(signum, self._old[signum])
        when = "the next log step" if jax.process_count() > 1 else "the next step"
        print(f"dpax: {signal.Signals(signum).name} received: stopping at {when} "
              "(send it again to exit now)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def on_log(self, step, row):
        if jax.process_count() > 1:
            self._agreed = any_process(self.signum is not None)

    def after_step(self, step):
        stop = self._agreed if jax.process_count() > 1 else self.signum is not None
        if not stop:
            return
        ckpt = self.checkpoint.ckpt if self.checkpoint else None
        if ckpt is None:
            kept = "; no `checkpoint_dir`, so it cannot be resumed"
        elif self.checkpoint.save(step):
            kept = f"; checkpoint saved in {ckpt.directory}, continue with `resume`"
        else:
            kept = (f"; its state is not finite, so it was not checkpointed: `resume` "
                    f"continues the newest checkpoint in {ckpt.directory}")
        if ckpt is not None:
            ckpt.close()
        cause = signal.Signals(self.signum).name if self.signum else "a signal to another rank"
        raise Preempted(f"stopped by {cause} at step {step}{kept}")


class Profile(Hook):
    """A JAX profiler trace of exactly steps `first`..`last` (1-based) into
    `logdir`: `*.xplane.pb` for TensorBoard's profile plugin and
    `*.trace.json.gz` for ui.perfetto.dev, under `logdir/plugins/profile/<run>/`."""

    def __init__(self, logdir: str, first: int, last: int, trainer):
        self.logdir, self.first, self.last, self.trainer = logdir, first, last, trainer
        self.active = False

    def _start_if(self, next_step: int) -> None:
        if next_step == self.first and not self.active:
            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
            self.active = True

    def on_start(self, step):
        self._start_if(step + 1)

    def after_step(self, step):
        if self.active and step >= self.last:
            with watchdog.waiting(step):  # the trace must hold the steps' work
                jax.block_until_ready(self.trainer.state)
            self.close()
        self._start_if(step + 1)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class LanguageModel(Hook):
    """What language-model users read, from a row of a token-weighted loss
    (`dpax.models.losses.lm_loss`): the weight is the token count.

      tokens, tokens_per_sec   real (unpadded) target tokens, and per second
      bytes_per_sec            the text those tokens cover, per second
      mfu                      model FLOPs per token x tokens/s over the peak
                               (`dpax.parallel.peak`: never above 1)
      bpb, eval_bpb            bits per byte: nats per token / ln 2 / bytes per
                               token (1 for byte tokens; a BPE's loss gives it)
      eval_perplexity          exp(eval loss in nats per token)

    Runs after `Evaluate` and before `Write` (hooks run in order)."""

    def __init__(self, flops_per_token: float, peak: Peak):
        self.flops_per_token, self.peak = flops_per_token, peak

    def on_log(self, step, row):
        if "weight" in row:
            row["tokens"] = int(row.pop("weight"))
        per_token = row.get("bytes_per_token", 1.0)
        if "weight_per_sec" in row:
            row["tokens_per_sec"] = row.pop("weight_per_sec")
            if "bytes_per_token" in row:
                row["bytes_per_sec"] = row["tokens_per_sec"] * per_token
            rate = self.flops_per_token * row["tokens_per_sec"]
            self.peak.observe(rate)  # a measured peak below it is raised: MFU <= 1
            row["mfu"] = rate / self.peak.flops
        if isinstance(row.get("loss"), float):
            row["bpb"] = row["loss"] / math.log(2) / per_token
        if isinstance(row.get("eval_loss"), float):
            row.update({f"eval_{k}": v for k, v in self.eval_row(
                row["eval_loss"], row.get("eval_bytes_per_token", 1.0)).items()})

    @staticmethod
    def eval_row(loss: float, bytes_per_token: float = 1.0) -> dict:
        """Bits per byte and perplexity of an eval loss in nats per token."""
        return {"bpb": loss / math.log(2) / bytes_per_token,
                "perplexity": math.exp(min(loss, 700.0))}
