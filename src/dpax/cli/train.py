"""`dpax train`: one training job, as a command and as a Python call,
`train(TrainConfig.from_flags(model="mlp", devices=4))`, both imported from
here. Everything that can be checked is checked before anything is written;
the params are saved whatever stops the run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import os
import sys

import jax

from dpax import config as cfg
from dpax.cli import devices, failures, outputs
from dpax.cli.exits import EXIT_STALLED
from dpax.cli.flags import add_flags, config_from_args
from dpax.cli.job import Job, TrainConfig, build, check_same_meaning
from dpax.cli.plot import plot_runs
from dpax.errors import DpaxError, Preempted, RunFailed, TooManyBadSteps, summary
from dpax.parallel import compile_cache, peak, watchdog
from dpax.parallel.arrays import all_finite
from dpax.parallel.distributed import is_writer
from dpax.parallel.mesh import describe
from dpax.training import hooks
from dpax.training.checkpoint import AUTO, LATEST, Checkpointer, locate
from dpax.training.trainer import Trainer

__all__ = ["RunResult", "TrainConfig", "train"]  # the job from Python

NAME = "train"


def add_parser(sub) -> None:
    parser = sub.add_parser(NAME, help="train a model data-parallel",
                            description="Train a model data-parallel on N devices.")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="load a config (e.g. a run's config.yaml); flags override it")
    add_flags(parser, TrainConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, TrainConfig))
    if config.distributed.from_environment().process_id in (None, 0):
        # Before joining a multi-process run: process 0 refuses alone, and
        # after joining it would wait at exit for peers that wait for it in
        # their first collective (30 s, then a traceback from each).
        outputs.refuse_another_run(config.output, config.checkpoint)
    devices.start(config.trainer.devices, config.distributed)
    # Before the model is built: its initialization's programs are cached too.
    compile_cache.use(config.trainer.compile_cache, jax.local_devices()[0])
    log = failures.current()
    if log is not None:  # a failure's details go to the run directory
        log.run_dir, log.rank = config.output.out, jax.process_index()
    train(config)
    return 0


@dataclasses.dataclass
class RunResult:
    trainer: Trainer
    history: list[dict]
    eval: dict
    steps: int
    steps_per_sec: float

    def summary(self) -> str:
        return outputs.summary_line(self.eval, self.steps, self.steps_per_sec)


def train(config: TrainConfig, *, log="stdout") -> RunResult:
    """Run one training job: writes `metrics.jsonl` and `params.npz` to
    `config.output.out` and checkpoints to `config.checkpoint.dir`.

    Args:
      log: a text stream for progress lines, None for silence; "stdout" is
        sys.stdout at call time (so a redirected stdout is honoured).
    """
    if log == "stdout":
        log = sys.stdout
    cfg.validate(config)
    # An option the model or optimizer ignores: refused for a new run only,
    # so that a run saved with one (before this was refused) still resumes.
    ignored = config.model.ignored() or config.optimizer.ignored()
    if ignored and config.checkpoint.resume is None:
        raise DpaxError(ignored)
    out = config.output
    writer_process = is_writer()  # only process 0 prints progress and writes --out
    with _removed_if_unused(outputs.check_dirs(out, config.checkpoint, writer_process)):
        job = build(config)
        # What is read per batch (streamed inputs) is checked before anything is
        # written: the training split on its first batch, and the eval split on
        # the first batch `evaluate` (default batch size) reads, or a bad one
        # stopped the run at its first evaluation.
        job.trainer.check(job.ds.x_train, job.ds.y_train, config.batch_size)
        job.trainer.check(job.ds.x_eval, job.ds.y_eval)
        config.check_length(job.total)
        ckpt = None if config.checkpoint.dir is None else Checkpointer(
            config.checkpoint.dir, config.checkpoint.keep)
        data_iter = job.input(0)  # batches of steps 0..total-1
        start = 0
        resume = config.checkpoint.resume
        held = ckpt.steps() if ckpt is not None else []
        if resume == AUTO:  # resume if there is something to resume, else start
            resume = LATEST if held else None
        if resume is None and held:
            # Orbax saves only past the newest step: this run's saves would fail.
            kept = ", which `overwrite` keeps" if out.overwrite else ""
            raise DpaxError(f"`checkpoint_dir={ckpt.directory}` holds another run's "
                            f"checkpoints (steps {', '.join(map(str, held))}){kept}; give "
                            "`resume` to continue that run, or an empty `checkpoint_dir`")
        if resume is not None:
            start, data_restored = _resume(resume, config, ckpt, job.trainer, data_iter)
            if start > job.total:  # refused before anything is written
                raise DpaxError(f"the checkpoint resumed is at step {start}, past the "
                                f"{job.total} steps of this run; give more `steps` (or "
                                "`epochs`), or `resume` from an earlier checkpoint")
            if not data_restored:  # saved by another process count: rebuilt from the step
                data_iter = job.input(start)
    if not writer_process:
        log = None
    # A language model's MFU divides by this (measured on CPU: before any step runs).
    mfu_peak = (peak.for_devices(job.trainer.backend.devices, config.trainer.precision)
                if job.ds.task == "lm" else None)
    resolved = _resolved(config, job)  # what config.yaml and the trackers record
    if out.out is not None and writer_process:
        if out.overwrite:
            outputs.clear_run(out.out)
        outputs.save_text(os.path.join(out.out, "config.yaml"), resolved.to_yaml())
        outputs.save_run_info(out.out, job.trainer.n_devices, mfu_peak,
                              job.trainer.compile_cache, job.trainer.backend.replicas)
        if job.ds.tokenizer is not None and job.ds.tokenizer.hf is not None:
            outputs.save_text(os.path.join(out.out, "tokenizer.json"),
                              job.ds.tokenizer.to_json())
    if log is not None and not out.quiet:
        groups = job.trainer.backend.replicas
        print(f"dpax: {config.model.name} on {job.ds.name}, {job.trainer.n_devices} device(s) "
              f"({config.trainer.backend}"
              + (f", --sharding {job.trainer.layout.name} in {groups} replica groups"
                 if groups > 1 else "")
              + f"), global batch {config.batch_size}, {job.total} steps"
              + (f", resumed at step {start}" if start else ""), file=log, flush=True)
        if out.verbose:
            print(describe(), file=log)
            if mfu_peak is not None:
                print(f"MFU peak: {mfu_peak.describe()}", file=log)
            print(f"compilation cache: {job.trainer.compile_cache or 'none'}", file=log)
            print(resolved.to_yaml().rstrip(), file=log, flush=True)
    # After the header line: a bar drawn before it would be broken by it.
    # A resumed run (even one resumed before its first checkpoint) continues its tracker runs.
    resumed = start > 0 or config.checkpoint.resume is not None
    with out.writers(job.total, start, log, writer_process, cfg.to_dict(resolved),
                     resumed) as writer, _watched(config):
        if out.out is not None and writer_process:
            writer.artifact(os.path.join(out.out, "config.yaml"))
        result = _run(job, ckpt, data_iter, start, writer, writer_process, mfu_peak)
        if out.tracker and writer_process:  # the run's picture, for the trackers
            writer.artifact(plot_runs([out.out]))
    if out.out is not None and writer_process and mfu_peak is not None:
        # Again: a measured peak rises when a step runs faster than it.
        outputs.save_run_info(out.out, job.trainer.n_devices, mfu_peak,
                              job.trainer.compile_cache, job.trainer.backend.replicas)
    if log is not None:
        print(result.summary(), file=log, flush=True)
    return result


def _run(job: Job, ckpt: Checkpointer | None, data_iter, start: int, writer,
         writer_process: bool, mfu_peak: peak.Peak | None) -> RunResult:
    """Train from the trainer's step to the end, then save and evaluate."""
    config, trainer, ds, total = job.config, job.trainer, job.ds, job.total
    position, write = hooks.TrackPosition(data_iter, start), hooks.Write(writer)
    checkpoint = None if ckpt is None else hooks.Checkpoint(
        ckpt, trainer, data_iter, job.meta(), config.checkpoint.every,
        config.checkpoint.every_minutes)
    profile = None
    if config.output.profile_steps is not None:
        profile = hooks.Profile(os.path.join(config.output.out, "profile"),
                                *config.output.profile_range(), trainer)

    def save_params(final: dict | None = None) -> str | None:
        """params.npz in `out`: the `final` params (checked finite by the
        caller), or the trainer's now unless they are not finite (a step
        applied with skip_nonfinite=False): such a file helps no one and would
        replace a good one."""
        if config.output.out is None:
            return None
        path = os.path.join(config.output.out, "params.npz")
        if writer_process:
            params = outputs.flat_params(trainer.params) if final is None else final
            if final is None and not all_finite(params):
                return None
            outputs.save_npz(path, params)
        return path

    def kept(e: RunFailed, path: str | None, what: str) -> RunFailed:
        if path:
            return RunFailed(f"{e}; {what} are in {path}")
        why = "no `out`" if config.output.out is None else "they are not finite"
        return RunFailed(f"{e}; {why}, so the params were not saved")

    with hooks.StopOnSignal(checkpoint) as stop:
        run_hooks = [hooks.Evaluate(trainer, {"x": ds.x_eval, "y": ds.y_eval},
                                    config.eval_every, total),
                     _language_model(job, mfu_peak), write, position, stop, checkpoint, profile]
        try:
            history = trainer.fit(ds.x_train, ds.y_train, batch_size=config.batch_size,
                                  until_step=total, seed=config.seed,
                                  log_every=config.log_every, batches=data_iter,
                                  hooks=[h for h in run_hooks if h is not None])
        except (TooManyBadSteps, Preempted):
            save_params()  # the last good params, whatever happens next
            raise
        except RunFailed as e:
            raise kept(e, save_params(), f"the params of step {position.step}") from None
        except DpaxError:
            raise
        except Exception as e:  # the runtime, a peer that died, a bug: say what is kept
            raise _unforeseen(e, save_params, trainer, ckpt) from e
        finally:
            if profile is not None:
                profile.close()
            data_iter.close()  # stops Grain worker processes, if any
    speed = write.steady_speed(total)
    if speed is None:
        speed = history[-1]["steps_per_sec"] if history else 0.0
    # A step skips a non-finite gradient; new params can still overflow (or an
    # optimizer's hyperparameter be NaN through the Python API). Checked once,
    # on the host copy params.npz needs anyway: such a run does not end in success.
    final = outputs.flat_params(trainer.params)
    if not all_finite(final):
        raise RunFailed(f"the params are not finite after step {total}: an update overflowed "
                        "or an optimizer hyperparameter is not finite; lower `lr` or clip "
                        "gradients (`clip_norm`). params.npz was not written")
    path = save_params(final)  # before the last checkpoint: a failed save must not cost them
    if ckpt is not None:
        try:
            ckpt.save(total, trainer.state_dict(), data_iter, job.meta())
            ckpt.close()
        except RunFailed as e:
            raise kept(e, path, "the final params") from None
    ev = trainer.evaluate(ds.x_eval, ds.y_eval)
    if ds.task == "lm":
        ev.update(hooks.LanguageModel.eval_row(ev["loss"], ev.get("bytes_per_token", 1.0)))
        ev.pop("weight", None)
    writer.write(total, {f"eval_{k}": v for k, v in ev.items()})
    return RunResult(trainer, history, ev, total, speed)


def _unforeseen(e: Exception, save_params, trainer: Trainer,
                ckpt: Checkpointer | None) -> RunFailed:
    """A failure dpax did not foresee, as a RunFailed that says what is kept:
    the trainer's params where one process can still read them (with several,
    reading them is a collective a failed peer would hang), and the newest
    checkpoint."""
    kept = []
    if jax.process_count() == 1:
        try:
            step, path = trainer.step, save_params()
        except Exception:  # the failure may be the devices'
            path = None
        if path:
            kept.append(f"the params of step {step} are in {path}")
        if ckpt is not None:  # a save in flight completes (with peers it waits on them)
            with contextlib.suppress(Exception):
                ckpt.close()
    newest = ckpt.newest_complete() if ckpt is not None else None
    if newest is not None:
        kept.append(f"the newest checkpoint is step {newest} in {ckpt.directory}")
    return RunFailed(f"{summary(e)}; {'; '.join(kept) or 'nothing was saved'}")


def _watched(config: TrainConfig):
    """A watchdog on the run's waits when it spans several processes (a
    single process has no peer to wait for)."""
    if jax.process_count() == 1:
        return contextlib.nullcontext()
    # JAX's own failure detection (a peer's missed heartbeats) aborts from C++;
    # Python's stacks then still show where this rank was.
    faulthandler.enable()
    return watchdog.installed(config.distributed.timeout, jax.process_index(),
                              on_stall=lambda: os._exit(EXIT_STALLED))  # no unwinding


def _resolved(config: TrainConfig, job: Job) -> TrainConfig:
    """`config` as this run took it, for config.yaml: the XLA:CPU tuning the
    environment chose written out, so the file alone reruns the same steps."""
    if config.trainer.xla_cpu_tuning is not None:
        return config
    taken = job.trainer.platform.xla_cpu_tuning
    return dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, xla_cpu_tuning=taken))


def _language_model(job: Job, peak_flops: peak.Peak | None) -> hooks.LanguageModel | None:
    """The LM metrics hook for text data: FLOPs per token from the model's
    shape, over the hardware's peak."""
    if peak_flops is None:
        return None
    flops = job.config.model.flops_per_token(job.trainer.param_count, job.config.data.seq_len,
                                             job.ds.n_out)
    return None if flops is None else hooks.LanguageModel(flops, peak_flops)


@contextlib.contextmanager
def _removed_if_unused(created: list[str]):
    """Bad input found after the output check leaves no directory behind: the
    ones the check made are removed while still empty."""
    try:
        yield
    except (RunFailed, TooManyBadSteps, Preempted):
        raise  # a run that started: not bad input
    except DpaxError:
        for path in created:
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        raise


def _resume(resume: str, config: TrainConfig, ckpt: Checkpointer | None, trainer: Trainer,
            data_iter) -> tuple[int, bool]:
    """Load the checkpoint `resume` names (LATEST or a path) into `trainer` (and
    `data_iter`, when it was saved by as many processes); returns (step,
    whether the data position was restored)."""
    if resume == LATEST:
        directory, step = ckpt.directory, None
    else:
        directory, step = locate(resume)
    source = ckpt if ckpt is not None and ckpt.directory == directory else Checkpointer(directory)
    step, meta = trainer.restore(source, data_iter, step,
                                 check=lambda meta: check_same_meaning(meta["config"], config))
    restored = meta["data_restored"] and data_iter.next_step == step
    return step, restored  # else the caller starts the batches at `step`
