"""dpax: data-parallel (SPMD) training on JAX, exactly equal to one device."""

import importlib

# Exports load on first use: `import dpax` (and the `dpax` command, which may
# restart its process before JAX starts) stays cheap.
_EXPORTS = {
    "check_equivalence": "dpax.check", "from_function": "dpax.bridge",
    "from_linen": "dpax.bridge", "TrainConfig": "dpax.config", "Dataset": "dpax.data",
    "MAX_SIMULATED_DEVICES": "dpax.devices", "describe": "dpax.devices",
    "select_devices": "dpax.devices", "simulate_devices": "dpax.devices",
    "DpaxError": "dpax.errors", "DpaxWarning": "dpax.errors", "RunFailed": "dpax.errors",
    "classification_loss": "dpax.losses", "classification_predict": "dpax.losses",
    "regression_loss": "dpax.losses", "regression_predict": "dpax.losses",
    "make_model": "dpax.models", "make_optimizer": "dpax.optim",
    "make_schedule": "dpax.optim", "scaled_lr": "dpax.optim", "BatchPlan": "dpax.pipeline",
    "train": "dpax.run", "pad_batch": "dpax.sharding", "replicas_in_sync": "dpax.sharding",
    "replicate": "dpax.sharding", "shard_batch": "dpax.sharding",
    "unreplicate": "dpax.sharding", "unshard": "dpax.sharding", "spmd": "dpax.spmd",
    "Trainer": "dpax.trainer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once imported, a plain attribute
        return value
    try:  # a submodule, e.g. dpax.data
        return importlib.import_module(f"dpax.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"dpax.{name}":
            raise
    raise AttributeError(f"module 'dpax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS, "data"])


__version__ = "0.1.0"

__all__ = [
    "MAX_SIMULATED_DEVICES", "BatchPlan", "Dataset", "DpaxError", "DpaxWarning", "RunFailed",
    "TrainConfig", "Trainer", "check_equivalence", "classification_loss", "from_function",
    "from_linen",
    "classification_predict", "data", "describe", "make_model", "make_optimizer",
    "make_schedule", "pad_batch", "regression_loss", "regression_predict", "replicas_in_sync",
    "replicate", "scaled_lr", "select_devices", "shard_batch", "simulate_devices", "spmd",
    "train", "unreplicate", "unshard",
]
