"""dpax: data-parallel (SPMD) training on JAX, exactly equal to one device.

The package's folders follow a batch's way: `data` (examples -> padded,
masked batches), `parallel` (devices, state layouts, collectives, backends),
`models` (dpax's models, losses, N-independent layers, other models brought
in), `training` (the step, the loop, the Trainer), `cli` (the commands),
`writers` (where metrics go), `xla_cpu` (XLA:CPU-only tuning), `bench`.
"""

import importlib

# Exports load on first use: `import dpax` stays cheap, and the `dpax` command
# sets the device count before JAX starts.
_EXPORTS = {
    # training
    "Trainer": "dpax.training.trainer", "check_equivalence": "dpax.training.check",
    "Hook": "dpax.training.loop", "LogTo": "dpax.training.loop",
    "make_optimizer": "dpax.training.optim", "make_schedule": "dpax.training.optim",
    "scaled_lr": "dpax.training.optim",
    # models and losses
    "make_model": "dpax.models.registry", "from_linen": "dpax.models.bridge",
    "from_function": "dpax.models.bridge",
    "classification_loss": "dpax.models.losses", "classification_predict": "dpax.models.losses",
    "regression_loss": "dpax.models.losses", "regression_predict": "dpax.models.losses",
    "lm_loss": "dpax.models.losses", "lm_predict": "dpax.models.losses",
    # data
    "Dataset": "dpax.data.datasets", "BatchPlan": "dpax.data.pipeline",
    "pad_batch": "dpax.data.batches",
    # devices and jax.pmap's idioms
    "MAX_SIMULATED_DEVICES": "dpax.parallel.mesh", "describe": "dpax.parallel.mesh",
    "select_devices": "dpax.parallel.mesh", "simulate_devices": "dpax.parallel.mesh",
    "spmd": "dpax.parallel.spmd", "replicate": "dpax.parallel.arrays",
    "unreplicate": "dpax.parallel.arrays", "shard_batch": "dpax.parallel.spmd",
    "unshard": "dpax.parallel.spmd", "replicas_in_sync": "dpax.parallel.spmd",
    # configs, and the CLI's job from Python
    "TrainerConfig": "dpax.training.trainer", "ModelConfig": "dpax.models.registry",
    "DataConfig": "dpax.data.datasets", "OptimizerConfig": "dpax.training.optim",
    "train": "dpax.cli.train", "TrainConfig": "dpax.cli.job",
    # errors: every exception dpax raises on purpose is a DpaxException
    "DpaxException": "dpax.errors", "DpaxError": "dpax.errors", "DpaxWarning": "dpax.errors",
    "RunFailed": "dpax.errors", "TooManyBadSteps": "dpax.errors", "Preempted": "dpax.errors",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once imported, a plain attribute
        return value
    try:  # a subpackage or module, e.g. dpax.data
        return importlib.import_module(f"dpax.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"dpax.{name}":
            raise
    raise AttributeError(f"module 'dpax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)
