"""Optax optimizers and learning-rate schedules by name, and their config.

The schedule is a function of the step count that lives in the optimizer
state, so a changing learning rate never recompiles the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from dpax import config as cfg

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
DEFAULT_LR = 3e-3  # unless the model has its own (`dpax.models.registry.ModelConfig.lr`)
# Each after `warmup_steps` of linear warmup from 0: the peak learning rate
# held; cosine or linear decay to `min_lr_ratio` of it at the run's end; or
# warmup-stable-decay (held, then linear decay over the last `decay_fraction`
# of the run, Hägele et al. 2024).
SCHEDULES = ("constant", "warmup-cosine", "warmup-linear", "wsd")
# Schedules that follow the run's length: a resume that changes it changes them.
BY_LENGTH = ("warmup-cosine", "warmup-linear", "wsd")


@dataclasses.dataclass
class OptimizerConfig:
    """The optimizer and its learning-rate schedule."""

    name: str = cfg.field("adam", "sgd, momentum, adam or adamw", flag="optimizer")
    lr: float | None = cfg.field(None, f"peak learning rate (default: the model's, "
                                 f"{DEFAULT_LR:g}; deep-mlp 1e-4)")
    schedule: str = cfg.field(
        "constant", "after the warmup: constant; warmup-cosine or warmup-linear (decay to "
        "min_lr_ratio x lr at the last step); wsd (warmup-stable-decay: constant, then "
        "linear decay over the last decay_fraction of the run)")
    warmup_steps: int = cfg.field(0, "linear warmup steps")
    min_lr_ratio: float = cfg.field(0.0, "the decaying schedules' final learning rate, as a "
                                    "fraction of lr")
    decay_fraction: float = cfg.field(0.2, "wsd: the fraction of the run its decay takes")
    scale_lr: bool = cfg.field(False, "scale lr by batch-size / reference-batch (linear rule)")
    reference_batch: int = cfg.field(128, "batch size the lr was tuned for (with `scale_lr`)")
    momentum: float = cfg.field(0.9, "momentum of the momentum optimizer")
    weight_decay: float = cfg.field(1e-4, "weight decay of adamw")

    def check(self) -> None:
        cfg.one_of(self, "name", OPTIMIZERS)
        cfg.one_of(self, "schedule", SCHEDULES)
        if self.lr is not None:
            cfg.number(self, "lr", 0, low_open=True)
        cfg.whole(self, "warmup_steps", low=0)
        cfg.number(self, "min_lr_ratio", 0, 1)
        cfg.number(self, "decay_fraction", 0, 1, low_open=True)
        cfg.whole(self, "reference_batch")
        cfg.number(self, "momentum", 0, 1)
        cfg.number(self, "weight_decay", 0)

    def ignored(self) -> str | None:
        """The refusal of an option set away from its default that this
        optimizer ignores (a new run would train silently without it), or None.
        Not part of `check`: a run saved with one still loads and resumes."""
        for option, takes in (("momentum", "momentum"), ("weight_decay", "adamw")):
            if cfg.changed(self, option) and self.name != takes:
                return (f"`{option}` is an option of `optimizer={takes}`, not of "
                        f"`optimizer={self.name}`")
        return None

    def build(self, batch_size: int, total_steps: int, model_lr: float | None = None
              ) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """The optimizer for a run of `total_steps` with global batches of
        `batch_size`, and its schedule (to report the learning rate). Unless
        `lr` is set: the model's learning rate, else `DEFAULT_LR`."""
        lr = self.resolved_lr(model_lr)
        lr = scaled_lr(lr, batch_size, self.reference_batch) if self.scale_lr else lr
        schedule = _schedule(lr, self.schedule, self.warmup_steps, total_steps,
                             self.min_lr_ratio, self.decay_fraction)
        return _optimizer(self.name, schedule, self.momentum, self.weight_decay), schedule

    def resolved_lr(self, model_lr: float | None = None) -> float:
        return self.lr or model_lr or DEFAULT_LR


def scaled_lr(lr: float, global_batch: int, reference_batch: int) -> float:
    """Linear scaling rule: lr * global_batch / reference_batch (Goyal et al. 2017).

    Args:
      lr: the learning rate tuned for batches of `reference_batch`.
      global_batch: the batch size of the run, over all devices.
      reference_batch: the batch size `lr` was tuned for.

    Returns:
      The learning rate scaled in proportion to the global batch.
    """
    return lr * global_batch / reference_batch


def make_schedule(lr: float, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int = 1, min_lr_ratio: float = 0.0,
                  decay_fraction: float = 0.2) -> optax.Schedule:
    """A learning-rate schedule: linear warmup from 0 to `lr`, then one of
    `SCHEDULES`.

    Args:
      lr: the peak learning rate (> 0).
      schedule: "constant" (`lr` after the warmup), "warmup-cosine" or
        "warmup-linear" (cosine or linear decay from `lr` to
        `min_lr_ratio * lr` at `total_steps`), or "wsd" (warmup-stable-decay:
        `lr` until the last `decay_fraction` of the run, then linear decay to
        `min_lr_ratio * lr` at `total_steps`).
      warmup_steps: steps of linear warmup from 0 to `lr` (>= 0).
      total_steps: the run's length, where a decay ends (at least one step
        past the warmup).
      min_lr_ratio: the final learning rate of a decay, as a fraction of `lr`.
      decay_fraction: "wsd": the fraction of `total_steps` its decay takes.

    Returns:
      An `optax.Schedule`: the learning rate as a function of the step count.

    Raises:
      DpaxError: an argument out of its range.
    """
    cfg.validate(OptimizerConfig(lr=lr, schedule=schedule, warmup_steps=warmup_steps,
                                 min_lr_ratio=min_lr_ratio, decay_fraction=decay_fraction))
    return _schedule(lr, schedule, warmup_steps, total_steps, min_lr_ratio, decay_fraction)


def make_optimizer(name: str, schedule: optax.Schedule, momentum: float = 0.9,
                   weight_decay: float = 1e-4) -> optax.GradientTransformation:
    """One of `OPTIMIZERS`, driven by `schedule`.

    Args:
      name: "sgd", "momentum", "adam" or "adamw".
      schedule: the learning rate as a function of the step count
        (`make_schedule`, or any `optax.Schedule`); it lives in the
        optimizer's state, so a changing rate never recompiles the step.
      momentum: the momentum of "momentum" (in [0, 1]).
      weight_decay: the weight decay of "adamw" (>= 0).

    Returns:
      The `optax.GradientTransformation`.

    Raises:
      DpaxError: an unknown `name`, or `momentum` or `weight_decay` out of range.
    """
    cfg.validate(OptimizerConfig(name=name, momentum=momentum, weight_decay=weight_decay))
    return _optimizer(name, schedule, momentum, weight_decay)


def _schedule(lr, schedule, warmup_steps, total_steps, min_lr_ratio=0.0,
              decay_fraction=0.2) -> optax.Schedule:
    end = lr * min_lr_ratio
    total = max(total_steps, warmup_steps + 1)
    if schedule == "warmup-cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total, end)
    if schedule == "constant":
        after, boundaries = [optax.constant_schedule(lr)], []
    elif schedule == "warmup-linear":
        after, boundaries = [optax.linear_schedule(lr, end, total - warmup_steps)], []
    else:  # wsd: the decay's steps are the run's last, never into the warmup
        decay = min(max(round(decay_fraction * total), 1), total - warmup_steps)
        stable = total - warmup_steps - decay
        after = [optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)]
        boundaries = [warmup_steps + stable]
    if warmup_steps:
        after = [optax.linear_schedule(0.0, lr, warmup_steps)] + after
        boundaries = [warmup_steps] + boundaries
    if len(after) == 1:
        return after[0]
    # join_schedules hands each piece the steps since its boundary.
    return optax.join_schedules(after, boundaries)


def _optimizer(name, schedule, momentum, weight_decay) -> optax.GradientTransformation:
    return {"sgd": lambda: optax.sgd(schedule),
            "momentum": lambda: optax.sgd(schedule, momentum=momentum),
            "adam": lambda: optax.adam(schedule),
            "adamw": lambda: optax.adamw(schedule, weight_decay=weight_decay)}[name]()


def state_stored_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` with its floating-point arrays of state (Adam's moments, a
    momentum) kept in `dtype` between steps: each update casts the state to
    the dtypes `tx` makes it in, updates in them, and casts the new state
    back. Scalars (counts, injected hyperparameters) stay as they are.

    Args:
      tx: any optax transformation.
      dtype: the stored dtype, e.g. `jnp.bfloat16` (half the bytes of f32).

    Returns:
      The transformation: the same updates as `tx` from a state rounded to
      `dtype` once per step.
    """
    tx = optax.with_extra_args_support(tx)

    def stored(tree):  # scalars (a count, an injected learning rate) keep their dtype
        return jax.tree.map(lambda a: a.astype(dtype) if _floating(a) and a.ndim else a, tree)

    def init(params):
        return stored(tx.init(params))

    def update(updates, state, params=None, **extra):
        # The dtypes tx keeps its state in, from the params' (or the updates') dtypes.
        computed = jax.eval_shape(tx.init, updates if params is None else params)
        state = jax.tree.map(lambda a, like: a.astype(like.dtype), state, computed)
        updates, state = tx.update(updates, state, params, **extra)
        return updates, stored(state)

    return optax.GradientTransformationExtraArgs(init, update)


def _floating(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)
