"""The jobs the CLI runs, as Python calls: `train`, `evaluate_checkpoint`,
`predict_checkpoint`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import warnings

import numpy as np
from flax import nnx, traverse_util

from dpax import data as data_mod
from dpax import models
from dpax.cli.config import DEFAULT_EPOCHS, TrainConfig
from dpax.cli.outputs import (
    clear_run,
    holds_run,
    save_npz,
    save_text,
    writable_dir,
    writable_file,
)
from dpax.data import augment
from dpax.data.pipeline import EVAL_BATCH, BatchPlan, train_input
from dpax.errors import DpaxError, DpaxWarning, Preempted, RunFailed, TooManyBadSteps
from dpax.models import losses
from dpax.parallel.backends import DEFAULT_BACKEND
from dpax.parallel.distributed import is_writer
from dpax.parallel.mesh import describe
from dpax.training import hooks, optim
from dpax.training.checkpoint import Checkpointer, locate
from dpax.training.trainer import Trainer
from dpax.writers import MultiWriter
from dpax.writers.console import console_writer
from dpax.writers.csv_file import CsvWriter
from dpax.writers.jsonl import JsonlWriter


@dataclasses.dataclass
class RunResult:
    trainer: Trainer
    history: list[dict]
    eval: dict
    steps: int
    steps_per_sec: float

    def summary(self) -> str:
        return summary_line(self.eval, self.steps, self.steps_per_sec)


def summary_line(ev: dict, steps: int | None = None, speed: float | None = None) -> str:
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


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    """One host array per parameter path, e.g. `conv1/kernel` or `layers/0/bias`."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(params))
    return {"/".join(map(str, k)): np.asarray(v) for k, v in flat.items()}


@dataclasses.dataclass
class Job:
    """Everything a config builds before training starts."""

    config: TrainConfig
    ds: data_mod.Dataset
    plan: BatchPlan
    total: int
    trainer: Trainer

    def meta(self) -> dict:
        """What a checkpoint needs besides the state: the resolved config, and
        the shapes to rebuild the model without the training data."""
        return {"config": dataclasses.asdict(self.config), "task": self.ds.task,
                "input_shape": list(self.ds.input_shape), "n_out": self.ds.n_out,
                "total": self.total}

    def input(self, start: int):
        """This process's training batches of steps `start..total-1`."""
        rows = self.trainer.backend.local_rows(self.trainer.padded(self.config.batch_size))
        return train_input({"x": self.ds.x_train, "y": self.ds.y_train}, self.plan, rows,
                           start, self.total, augment.parse(self.config.augment),
                           self.config.data_workers)


def build(config: TrainConfig) -> Job:
    """Data, model, optimizer and Trainer for a validated config."""
    ds = data_mod.load(config.data, config.seq_len, config.x_column, config.y_column)
    aug = augment.parse(config.augment)
    if aug is not None:
        aug.check(ds.input_shape)
    plan = BatchPlan(len(ds.x_train), config.batch_size, config.seed)
    total = plan.total_steps(config.steps, config.epochs, DEFAULT_EPOCHS)
    trainer = make_trainer(config, ds.task, ds.input_shape, ds.n_out, total)
    return Job(config, ds, plan, total, trainer)


def make_trainer(config: TrainConfig, task: str, input_shape: tuple[int, ...], n_out: int,
                 total: int) -> Trainer:
    """The config's model (for examples of `input_shape`), optimizer and Trainer."""
    lr = config.lr
    if config.scale_lr:
        lr = optim.scaled_lr(lr, config.batch_size, config.reference_batch)
    schedule = optim.make_schedule(lr, config.schedule, config.warmup_steps, total)
    tx = optim.make_optimizer(config.optimizer, schedule, config.momentum, config.weight_decay)
    loss_fn, predict_fn = losses.for_task(task)
    model = models.make_model(config.model, input_shape, n_out, config.seed, task,
                              **model_options(config))
    return Trainer(model, loss_fn, tx, devices=config.devices, backend=config.backend,
                   predict_fn=predict_fn, schedule=schedule, grad_accum=config.grad_accum,
                   precision=config.precision, allreduce_dtype=config.allreduce_dtype,
                   max_bad_steps=config.max_bad_steps,
                   steps_per_call=config.steps_per_call, seed=config.seed,
                   sync_batchnorm=config.sync_batchnorm, sharding=config.sharding,
                   clip_norm=config.clip_norm, ema_decay=config.ema_decay)


def model_options(config: TrainConfig) -> dict:
    """The config's options for models that take them (`models.TEXT_MODELS`)."""
    return {"layers": config.layers, "width": config.width, "heads": config.heads,
            "dropout": config.dropout, "remat": config.remat}


def _check_same_meaning(saved: dict, config: TrainConfig) -> None:
    """Refuse a resume that changes what is trained; say what a longer or
    shorter run changes of the schedule."""
    old = TrainConfig.from_saved(saved)
    was = old.what_is_trained()
    for key, value in config.what_is_trained().items():
        if was.get(key) != value:
            raise DpaxError(f"cannot resume: `{key}` was {was.get(key)!r} in the checkpoint, "
                            f"now {value!r}; resume with the same `{key}` or start a new run")
    if (old.steps, old.epochs) != (config.steps, config.epochs) and (
            config.schedule == "warmup-cosine"):
        warnings.warn(f"the run's length changed: the {config.schedule} schedule follows "
                      "the new length from here", DpaxWarning, stacklevel=2)


def _keep_metrics_up_to(path: str, step: int) -> None:
    """Drop log rows past the resumed step, so every step is logged once."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


def train(config: TrainConfig, *, log="stdout") -> RunResult:
    """Run one training job: writes `metrics.jsonl` and `params.npz` to
    `config.out` and checkpoints to `config.checkpoint_dir`.

    Everything that can be checked is checked before anything is written: the
    config, the output directories, the data and the model.

    Args:
      log: a text stream for progress lines, None for silence; "stdout" is
        sys.stdout at call time (so a redirected stdout is honoured).
    """
    if log == "stdout":
        log = sys.stdout
    config.validate()
    writer_process = is_writer()  # only process 0 prints progress and writes --out
    with _removed_if_unused(_check_outputs(config, writer_process)):
        job = build(config)
        config.check_length(job.total)
        ckpt = None if config.checkpoint_dir is None else Checkpointer(config.checkpoint_dir,
                                                                       config.keep)
        data_iter = job.input(0)  # batches of steps 0..total-1
        start = 0
        if config.resume is not None:
            start, data_restored = _resume(config, ckpt, job.trainer, data_iter)
            if not data_restored:  # saved by another process count: rebuilt from the step
                data_iter = job.input(start)
    if not writer_process:
        log = None
    if config.out is not None and writer_process:
        if config.overwrite:
            clear_run(config.out)
        save_text(os.path.join(config.out, "config.yaml"), config.to_yaml())
    if log is not None and not config.quiet:
        print(f"dpax: {config.model} on {job.ds.name}, {job.trainer.n_devices} device(s) "
              f"({config.backend}), global batch {config.batch_size}, {job.total} steps"
              + (f", resumed at step {start}" if start else ""), file=log, flush=True)
        if config.verbose:
            print(describe(), file=log)
            print(config.to_yaml().rstrip(), file=log, flush=True)
    # After the header line: a bar drawn before it would be broken by it.
    writer = _writers(config, job.total, start, log, writer_process)
    return _run(job, ckpt, data_iter, start, writer, log, writer_process)


def _run(job: Job, ckpt: Checkpointer | None, data_iter, start: int, writer, log,
         writer_process: bool) -> RunResult:
    """Train from the trainer's step to the end, then save and evaluate; the
    params are saved whatever stops the run."""
    config, trainer, ds, total = job.config, job.trainer, job.ds, job.total
    position, write = hooks.TrackPosition(data_iter, start), hooks.Write(writer)
    checkpoint = None if ckpt is None else hooks.Checkpoint(ckpt, trainer, data_iter,
                                                            job.meta(), config.checkpoint_every)
    profile = None
    if config.profile_steps is not None:
        profile = hooks.Profile(os.path.join(config.out, "profile"), *config.profile_range(),
                                trainer)

    def save_params(params: dict | None = None) -> str | None:
        if config.out is None:
            return None
        path = os.path.join(config.out, "params.npz")
        if writer_process:
            save_npz(path, flat_params(trainer.params) if params is None else params)
        return path

    with hooks.StopOnSignal(checkpoint) as stop:
        run_hooks = [hooks.Evaluate(trainer, {"x": ds.x_eval, "y": ds.y_eval},
                                    config.eval_every, total),
                     _language_model(job), write, position, stop, checkpoint, profile]
        try:
            history = trainer.fit(ds.x_train, ds.y_train, batch_size=config.batch_size,
                                  until_step=total, seed=config.seed,
                                  log_every=config.log_every, batches=data_iter,
                                  hooks=[h for h in run_hooks if h is not None])
        except (TooManyBadSteps, Preempted):
            writer.close()
            save_params()  # the last good params, whatever happens next
            raise
        except RunFailed as e:
            writer.close()
            path = save_params()
            raise RunFailed(f"{e}; the params of step {position.step} are in {path}" if path
                            else f"{e}; no `out`, so the params were not saved") from None
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
    final = flat_params(trainer.params)
    if not all(np.isfinite(v).all() for v in final.values()):
        writer.close()
        raise RunFailed(f"the params are not finite after step {total}: an update overflowed "
                        "or an optimizer hyperparameter is not finite; lower `lr` or clip "
                        "gradients (`clip_norm`). params.npz was not written")
    path = save_params(final)  # before the last checkpoint: a failed save must not cost them
    if ckpt is not None:
        try:
            ckpt.save(total, trainer.state_dict(), data_iter, job.meta())
            ckpt.close()
        except RunFailed as e:
            writer.close()
            raise RunFailed(f"{e}; the final params are in {path}" if path
                            else f"{e}; no `out`, so the params were not saved") from None
    ev = trainer.evaluate(ds.x_eval, ds.y_eval)
    if ds.task == "lm":
        ev.update(hooks.LanguageModel.eval_row(ev["loss"]))
        ev.pop("weight", None)
    writer.write(total, {f"eval_{k}": v for k, v in ev.items()})
    writer.close()
    result = RunResult(trainer, history, ev, total, speed)
    if log is not None:
        print(result.summary(), file=log, flush=True)
    return result


def _language_model(job: Job) -> hooks.LanguageModel | None:
    """The LM metrics hook for text data: FLOPs per token from the model's
    shape, the peak from a matmul measured here (`machine_peak`)."""
    if job.ds.task != "lm":
        return None
    from dpax.models.gpt import flops_per_token

    c = job.config
    n = job.trainer.param_count - c.seq_len * c.width  # the position table only adds
    return hooks.LanguageModel(flops_per_token(n, c.layers, c.width, c.seq_len),
                               machine_peak(job.trainer.backend.devices))


def machine_peak(devices) -> float:
    """Peak f32 FLOP/s of the hardware under `devices` (the trainer's: every
    process's), measured: one device's matmul rate, times the devices on
    accelerators; simulated CPU devices share one host's cores, so there it
    counts once per process."""
    import jax

    from dpax.bench.timing import matmul_peak

    one = matmul_peak(repeats=3)
    if devices[0].platform == "cpu":
        return one * jax.process_count()
    return one * len(devices)


@contextlib.contextmanager
def _removed_if_unused(created: list[str]):
    """Bad input found after the output check leaves no directory behind: the
    ones the check made are removed while still empty."""
    try:
        yield
    except DpaxError:
        for path in created:
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        raise


def _check_outputs(config: TrainConfig, writer_process: bool) -> list[str]:
    """Refuse an `out` that holds another run (unless overwriting or resuming)
    and make sure every output directory can be written; returns the
    directories this made."""
    created = []
    if config.out is not None and writer_process:
        if holds_run(config.out) and not config.overwrite and config.resume is None:
            raise DpaxError(f"`out={config.out}` already holds a run; give a new `out`, "
                            "`overwrite=True` to replace it, or `resume` to continue it")
        if writable_dir(config.out, "out"):
            created.append(config.out)
    if config.checkpoint_dir is not None and writable_dir(config.checkpoint_dir,
                                                          "checkpoint_dir"):
        created.append(config.checkpoint_dir)
    return created


def _writers(config: TrainConfig, total: int, start: int, log, writer_process: bool):
    writers = []
    if log is not None and not config.quiet:
        writers.append(console_writer(total, start, log, config.verbose))
    if config.out is not None and writer_process:
        jsonl = os.path.join(config.out, "metrics.jsonl")
        _keep_metrics_up_to(jsonl, start)
        writers.append(JsonlWriter(jsonl, append=start > 0))
        writers.append(CsvWriter(os.path.join(config.out, "metrics.csv"), append=start > 0))
        if config.tensorboard:
            from dpax.writers.tensorboard import TensorBoardWriter

            writers.append(TensorBoardWriter(os.path.join(config.out, "tensorboard")))
    return MultiWriter(writers)


def _resume(config: TrainConfig, ckpt: Checkpointer | None, trainer: Trainer,
            data_iter) -> tuple[int, bool]:
    """Load the checkpoint into `trainer` (and `data_iter`, when it was saved by
    as many processes); returns (step, whether the data position was restored)."""
    if config.resume == "latest":
        directory, step = ckpt.directory, None
    else:
        directory, step = locate(config.resume)
    source = ckpt if ckpt is not None and ckpt.directory == directory else Checkpointer(directory)
    step, state, meta = source.restore(
        trainer.state_template(), data_iter, step,
        check=lambda meta: _check_same_meaning(meta["config"], config))
    trainer.load_state_dict(state)
    restored = meta["data_restored"] and data_iter.next_step == step
    return step, restored  # else the caller starts the batches at `step`


@dataclasses.dataclass
class Loaded:
    """A Trainer holding a checkpoint's state, and what the checkpoint says."""

    trainer: Trainer
    config: TrainConfig  # the run's config, with this process's devices and backend
    meta: dict  # task, input_shape, n_out, total


def load_checkpoint(path: str, devices: int | None = None,
                    backend: str = DEFAULT_BACKEND) -> Loaded:
    """A Trainer holding a checkpoint's state, on any device count. The model is
    built from the checkpoint's own shapes: no data is read."""
    directory, step = locate(path)
    ckpt = Checkpointer(directory)
    steps = ckpt.steps()
    if step is None and not steps:
        raise DpaxError(f"no checkpoint in {directory}")
    newest = step if step is not None else steps[-1]
    try:
        meta = ckpt.read_meta(newest)
    except Exception as e:  # Orbax raises many types for damaged files
        raise DpaxError(f"checkpoint step {newest} in {directory} is unreadable "
                        f"({type(e).__name__}); give an older step directory") from None
    saved = TrainConfig.from_saved(meta["config"])
    # The run's sharding where the backend allows it: a model that needed
    # sharding to train needs it to evaluate.
    sharding = saved.sharding if backend == "shard_map" else "replicated"
    config = dataclasses.replace(
        saved, devices=devices, backend=backend, sharding=sharding, resume=None,
        checkpoint_dir=None, checkpoint_every=0, out=None, coordinator=None, num_processes=None,
        process_id=None, overwrite=False)
    config.validate()
    trainer = make_trainer(config, meta["task"], tuple(meta["input_shape"]), meta["n_out"],
                           meta.get("total", 1))
    _, state, _ = ckpt.restore(trainer.state_template(), None, step)
    trainer.load_state_dict(state)
    ckpt.close()
    return Loaded(trainer, config, meta)


def _check_fits(ds: data_mod.Dataset, meta: dict) -> None:
    """Refuse data the checkpoint's model cannot evaluate, naming what differs."""
    shape = tuple(meta["input_shape"])
    if ds.input_shape != shape:
        raise DpaxError(f"data {ds.name} has examples of shape {ds.input_shape}; the "
                        f"checkpoint's model takes {shape}")
    if ds.task != meta["task"]:
        raise DpaxError(f"data {ds.name} is a {ds.task} set; the checkpoint's model does "
                        f"{meta['task']}")
    if ds.task == "classification" and ds.n_out > meta["n_out"]:
        raise DpaxError(f"data {ds.name} has labels up to {ds.n_out - 1}; the checkpoint's "
                        f"model has {meta['n_out']} classes (0..{meta['n_out'] - 1})")


def evaluate_checkpoint(path: str, data: str | None = None, devices: int | None = None,
                        backend: str = DEFAULT_BACKEND, batch_size: int = EVAL_BATCH) -> dict:
    """Eval loss and accuracy of a checkpoint on the eval split of `data`
    (default: the data it was trained on)."""
    loaded = load_checkpoint(path, devices, backend)
    ds = data_mod.load(data or loaded.config.data, loaded.config.seq_len,
                       loaded.config.x_column, loaded.config.y_column)
    _check_fits(ds, loaded.meta)
    return loaded.trainer.evaluate(ds.x_eval, ds.y_eval, batch_size)


def predict_checkpoint(path: str, data: str, out: str, devices: int | None = None,
                       backend: str = DEFAULT_BACKEND, batch_size: int = EVAL_BATCH) -> np.ndarray:
    """Predictions of a checkpoint for every row of `x` in the .npz `data`,
    written to `out` as an .npz with array `predictions`."""
    if is_writer():
        writable_file(out, "out", (".npz",))
    x = data_mod.read_inputs(data)
    loaded = load_checkpoint(path, devices, backend)
    shape = tuple(loaded.meta["input_shape"])
    if tuple(x.shape[1:]) != shape:
        raise DpaxError(f"{data}: examples of shape {x.shape[1:]}, the checkpoint's model "
                        f"takes {shape}")
    preds = loaded.trainer.predict(x, batch_size)
    if is_writer():
        save_npz(out, {"predictions": preds})
    return preds
