"""`dpax predict`: a checkpoint's prediction for every row of an .npz."""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from dpax import config as cfg
from dpax.cli import devices
from dpax.cli.evaluate import EvalConfig
from dpax.cli.flags import add_flags, config_from_args
from dpax.cli.job import load_checkpoint
from dpax.cli.outputs import save_npz, writable_file
from dpax.data.datasets import read_inputs
from dpax.data.pipeline import EVAL_BATCH
from dpax.errors import DpaxError
from dpax.parallel.backends import DEFAULT_BACKEND
from dpax.parallel.distributed import is_writer, refuse_together

NAME = "predict"


@dataclasses.dataclass
class PredictConfig(EvalConfig):
    """`dpax predict`: a checkpoint's prediction for every row of an .npz."""

    data: str = cfg.field(None, ".npz with an array x of inputs", required=True,
                          metavar="X.npz")
    out: str = cfg.field(None, "where to write the array 'predictions'", required=True,
                         metavar="PREDS.npz")
    overwrite: bool = cfg.field(False, "replace an existing --out file (default: refuse)")


def add_parser(sub) -> None:
    text = "predict every row of an .npz with a checkpoint"
    add_flags(sub.add_parser(NAME, help=text, description=text[0].upper() + text[1:] + "."),
              PredictConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, PredictConfig))
    devices.start(config.devices)
    preds = predict_checkpoint(config.checkpoint, config.data, config.out, config.devices,
                               config.backend, config.batch_size, config.overwrite)
    print(f"wrote {len(preds)} predictions to {config.out}")
    return 0


def predict_checkpoint(path: str, data: str, out: str, devices: int | None = None,
                       backend: str = DEFAULT_BACKEND, batch_size: int = EVAL_BATCH,
                       overwrite: bool = False) -> np.ndarray:
    """Predictions of a checkpoint for every row of `x` in the .npz `data`,
    written to `out` as an .npz with array `predictions`; an existing `out`
    (the data itself, a run's params) only with `overwrite`."""
    def check_out():  # process 0 writes; every process refuses with it
        if is_writer():
            writable_file(out, "out", (".npz",))
            if os.path.exists(out) and not overwrite:
                raise DpaxError(f"`out={out}` exists; give another path, or `overwrite` to "
                                "replace it")

    refuse_together(check_out, lambda process: DpaxError(
        f"process {process} cannot write `out={out}`; see its error"))
    x = read_inputs(data)
    loaded = load_checkpoint(path, devices, backend)
    shape = tuple(loaded.meta["input_shape"])
    if tuple(x.shape[1:]) != shape:
        raise DpaxError(f"{data}: examples of shape {x.shape[1:]}, the checkpoint's model "
                        f"takes {shape}")
    preds = loaded.trainer.predict(x, batch_size)
    if is_writer():
        save_npz(out, {"predictions": preds})
    return preds
