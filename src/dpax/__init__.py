"""dpax: data-parallel (SPMD) training on JAX, exactly equal to one device."""

from dpax import data
from dpax.check import check_equivalence
from dpax.config import TrainConfig
from dpax.data import Dataset
from dpax.devices import MAX_SIMULATED_DEVICES, describe, select_devices, simulate_devices
from dpax.errors import DpaxError, DpaxWarning, RunFailed
from dpax.losses import (
    classification_loss,
    classification_predict,
    regression_loss,
    regression_predict,
)
from dpax.models import make_model
from dpax.optim import make_optimizer, make_schedule, scaled_lr
from dpax.pipeline import BatchPlan
from dpax.run import train
from dpax.sharding import (
    pad_batch,
    replicas_in_sync,
    replicate,
    shard_batch,
    unreplicate,
    unshard,
)
from dpax.spmd import spmd
from dpax.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "MAX_SIMULATED_DEVICES", "BatchPlan", "Dataset", "DpaxError", "DpaxWarning", "RunFailed",
    "TrainConfig", "Trainer", "check_equivalence", "classification_loss",
    "classification_predict", "data", "describe", "make_model", "make_optimizer",
    "make_schedule", "pad_batch", "regression_loss", "regression_predict", "replicas_in_sync",
    "replicate", "scaled_lr", "select_devices", "shard_batch", "simulate_devices", "spmd",
    "train", "unreplicate", "unshard",
]
