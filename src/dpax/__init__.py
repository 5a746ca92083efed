"""dpax: data-parallel (SPMD) training on JAX, exactly equal to one device.

The public API is the names below: the Trainer and its config, models and
losses, optimizers, the devices, the equivalence check, hooks and the
exceptions. `dpax.pmap` holds `jax.pmap`'s idioms for code written that way;
`dpax.cli.train` is the `dpax train` job as a Python call
(`train(TrainConfig.from_flags(...))`).

The package's folders follow a batch's way: `data` (examples -> padded,
masked batches), `collectives` (sums over the devices), `models` (dpax's
models, losses, N-independent layers, other models brought in), `parallel`
(devices, state layouts, backends), `analysis` (what a step's jaxpr says
before it runs), `training` (the step, the loop, the Trainer), `cli` (the
commands), `writers` (where metrics go), `xla_cpu` (the opt-in XLA:CPU
tuning), `bench`; tests/test_structure.py holds their layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Type checkers and IDEs read these imports; at run time each name loads on
# first use, from the module `_EXPORTS` names (tests/test_api.py keeps the two
# equal).
# The `dpax` command restarts its process before JAX is imported
# (`dpax.__main__`), and it imports this package first: importing them here
# would load JAX, Flax, Orbax and Grain twice on each command that computes.
if TYPE_CHECKING:
    from dpax import pmap
    from dpax.errors import DpaxError, DpaxWarning, Preempted, RunFailed, TooManyBadSteps
    from dpax.models.bridge import from_function, from_linen
    from dpax.models.losses import (
        classification_loss,
        classification_predict,
        lm_loss,
        lm_predict,
        regression_loss,
        regression_predict,
    )
    from dpax.models.registry import make_model
    from dpax.parallel.mesh import select_devices, simulate_devices
    from dpax.training.check import check_equivalence
    from dpax.training.loop import Hook, OnLog
    from dpax.training.optim import make_optimizer, make_schedule, scaled_lr
    from dpax.training.trainer import Trainer, TrainerConfig

# `pmap` is a module, loaded like the subpackages.
_EXPORTS = {
    **dict.fromkeys(("DpaxError", "DpaxWarning", "Preempted", "RunFailed", "TooManyBadSteps"),
                    "dpax.errors"),
    **dict.fromkeys(("from_function", "from_linen"), "dpax.models.bridge"),
    **dict.fromkeys(("classification_loss", "classification_predict", "lm_loss", "lm_predict",
                     "regression_loss", "regression_predict"), "dpax.models.losses"),
    "make_model": "dpax.models.registry",
    **dict.fromkeys(("select_devices", "simulate_devices"), "dpax.parallel.mesh"),
    "check_equivalence": "dpax.training.check",
    **dict.fromkeys(("Hook", "OnLog"), "dpax.training.loop"),
    **dict.fromkeys(("make_optimizer", "make_schedule", "scaled_lr"), "dpax.training.optim"),
    **dict.fromkeys(("Trainer", "TrainerConfig"), "dpax.training.trainer"),
}

__version__ = "0.1.0"

__all__ = [
    # training
    "Trainer", "TrainerConfig", "Hook", "OnLog", "check_equivalence",
    "make_optimizer", "make_schedule", "scaled_lr",
    # models and losses
    "make_model", "from_linen", "from_function",
    "classification_loss", "classification_predict",
    "regression_loss", "regression_predict", "lm_loss", "lm_predict",
    # devices, and jax.pmap's idioms
    "simulate_devices", "select_devices", "pmap",
    # errors: every exception dpax raises on purpose is a DpaxError
    "DpaxError", "RunFailed", "TooManyBadSteps", "Preempted", "DpaxWarning",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once imported, a plain attribute
        return value
    try:  # a subpackage or module, e.g. dpax.data or dpax.pmap
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    if name in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: it is "
                             f"{_MOVED[name]} now (docs/python-api.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Top-level names that moved on 2026-11-29, and where they live now.
_MOVED = {
    **{n: f"dpax.pmap.{n}" for n in ("spmd", "replicate", "unreplicate", "shard_batch",
                                      "unshard", "replicas_in_sync")},
    "train": "dpax.cli.train.train", "TrainConfig": "dpax.cli.train.TrainConfig",
    "LogTo": "dpax.OnLog", "DpaxException": "dpax.DpaxError (the one base)",
    "describe": "dpax.parallel.mesh.describe", "Dataset": "dpax.data.datasets.Dataset",
    "BatchPlan": "dpax.data.pipeline.BatchPlan", "pad_batch": "dpax.data.batches.pad_batch",
    "MAX_SIMULATED_DEVICES": "dpax.parallel.mesh.MAX_SIMULATED_DEVICES",
    "ModelConfig": "dpax.models.registry.ModelConfig",
    "DataConfig": "dpax.data.datasets.DataConfig",
    "OptimizerConfig": "dpax.training.optim.OptimizerConfig",
}


def __dir__():
    return sorted([*globals(), *__all__])
