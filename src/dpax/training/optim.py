"""Optax optimizers and learning-rate schedules by name.

The schedule is a function of the step count that lives in the optimizer
state, so a changing learning rate never recompiles the step.
"""

from __future__ import annotations

import math

import optax

from dpax.errors import DpaxError

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "warmup-cosine")


def scaled_lr(lr: float, global_batch: int, reference_batch: int) -> float:
    """Linear scaling rule: lr * global_batch / reference_batch (Goyal et al. 2017)."""
    return lr * global_batch / reference_batch


def make_schedule(
    lr: float, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 1
) -> optax.Schedule:
    """A learning-rate schedule: constant (after optional linear warmup) or
    linear warmup then cosine decay to 0 at `total_steps`."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise DpaxError(f"`lr` must be a finite number > 0, got {lr!r}")
    if schedule not in SCHEDULES:
        raise DpaxError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule == "warmup-cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1)
        )
    if warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)],
            [warmup_steps],
        )
    return optax.constant_schedule(lr)


def make_optimizer(
    name: str, schedule: optax.Schedule, momentum: float = 0.9, weight_decay: float = 1e-4
) -> optax.GradientTransformation:
    """One of OPTIMIZERS, driven by `schedule`."""
    if name == "sgd":
        return optax.sgd(schedule)
    if name == "momentum":
        return optax.sgd(schedule, momentum=momentum)
    if name == "adam":
        return optax.adam(schedule)
    if name == "adamw":
        return optax.adamw(schedule, weight_decay=weight_decay)
    raise DpaxError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
