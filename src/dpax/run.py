"""`train(config)`: the whole job the CLI runs, as one Python call."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
import optax
from flax import nnx, traverse_util

from dpax import data as data_mod
from dpax import models, optim
from dpax.config import TrainConfig
from dpax.distributed import is_writer
from dpax.pipeline import BatchPlan
from dpax.trainer import TooManyBadSteps, Trainer, default_loss
from dpax.writers import ConsoleWriter, JsonlWriter, MultiWriter, save_params


@dataclasses.dataclass
class RunResult:
    trainer: Trainer
    history: list[dict]
    eval: dict
    steps: int
    steps_per_sec: float

    def summary(self) -> str:
        parts = []
        if "accuracy" in self.eval:
            parts.append(f"eval accuracy {self.eval['accuracy']:.3f}")
        parts.append(f"eval loss {self.eval['loss']:.4g}")
        parts += [f"steps {self.steps}", f"{self.steps_per_sec:.1f} steps/s"]
        return "  ".join(parts)


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    """One host array per parameter path, e.g. `conv1/kernel`."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(params), sep="/")
    return {k: np.asarray(v) for k, v in flat.items()}


def train(config: TrainConfig, *, log=sys.stdout) -> RunResult:
    """Run one training job; writes `metrics.jsonl` and `params.npz` to `config.out`."""
    config.validate()
    ds = data_mod.load(config.data)
    plan = BatchPlan(len(ds.x_train), config.batch_size, config.seed)
    total = config.total_steps(plan.steps_per_epoch)
    lr = config.lr
    if config.scale_lr:
        lr = optim.scaled_lr(lr, config.batch_size, config.reference_batch)
    schedule = optim.make_schedule(lr, config.schedule, config.warmup_steps, total)
    tx = optim.make_optimizer(config.optimizer, schedule, config.momentum, config.weight_decay)
    if config.clip_norm is not None:
        # Clipping sees the reduced gradient, so every replica clips identically.
        tx = optax.chain(optax.clip_by_global_norm(config.clip_norm), tx)
    loss_fn, predict_fn = default_loss(ds.task)
    model = models.make_model(config.model, ds.input_shape, ds.n_out, config.seed)
    trainer = Trainer(model, loss_fn, tx, devices=config.devices, backend=config.backend,
                      predict_fn=predict_fn, schedule=schedule, grad_accum=config.grad_accum,
                      precision=config.precision, allreduce_dtype=config.allreduce_dtype,
                      max_bad_steps=config.max_bad_steps)

    writer_process = is_writer()  # only process 0 prints progress and writes --out
    if not writer_process:
        log = None
    writers: list = [] if log is None else [ConsoleWriter(total, log)]
    if config.out is not None and writer_process:
        os.makedirs(config.out, exist_ok=True)
        writers.append(JsonlWriter(os.path.join(config.out, "metrics.jsonl")))
    writer = MultiWriter(writers)

    first_log: list[tuple[int, float]] = []  # (step, time) of the first log, after compiling

    def on_log(step: int, row: dict) -> None:
        if not first_log:
            first_log.append((step, time.perf_counter()))
        if config.eval_every and step % config.eval_every == 0 and step < total:
            ev = trainer.evaluate(ds.x_eval, ds.y_eval)
            row.update({f"eval_{k}": v for k, v in ev.items() if k != "examples"})
        writer.write(step, row)

    if log is not None:
        print(f"dpax: {config.model} on {ds.name}, {trainer.n_devices} device(s) "
              f"({config.backend}), global batch {config.batch_size}, {total} steps",
              file=log, flush=True)
    try:
        history = trainer.fit(ds.x_train, ds.y_train, batch_size=config.batch_size, steps=total,
                              seed=config.seed, log_every=config.log_every, on_log=on_log)
    except TooManyBadSteps:
        writer.close()
        if config.out is not None and writer_process:  # keep the last good params
            save_params(os.path.join(config.out, "params.npz"), flat_params(trainer.params))
        raise
    (s0, t0), now = first_log[0], time.perf_counter()
    # Steady speed: the first log interval holds the compilation, so it is left out.
    speed = (total - s0) / (now - t0) if total > s0 else history[-1]["steps_per_sec"]
    ev = trainer.evaluate(ds.x_eval, ds.y_eval)
    writer.write(total, {f"eval_{k}": v for k, v in ev.items()})
    writer.close()
    if config.out is not None and writer_process:
        save_params(os.path.join(config.out, "params.npz"), flat_params(trainer.params))
    result = RunResult(trainer, history, ev, total, speed)
    if log is not None:
        print(result.summary(), file=log, flush=True)
    return result
