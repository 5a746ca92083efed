"""`dpax eval`: a checkpoint's eval loss and metrics, on any device count."""

from __future__ import annotations

import argparse
import dataclasses

from dpax import config as cfg
from dpax.cli import devices
from dpax.cli.flags import add_flags, config_from_args
from dpax.cli.job import load_checkpoint
from dpax.cli.outputs import summary_line
from dpax.data.datasets import load
from dpax.data.pipeline import EVAL_BATCH
from dpax.errors import DpaxError
from dpax.parallel.backends import DEFAULT_BACKEND, check_backend

NAME = "eval"


@dataclasses.dataclass
class EvalConfig:
    """`dpax eval`: a checkpoint's eval loss and metrics."""

    checkpoint: str = cfg.field(None, "a checkpoint directory (newest step) or one step "
                                "directory", required=True, metavar="PATH")
    data: str | None = cfg.field(
        None, "data whose eval split is evaluated, the part training holds out of it "
        "(docs/data.md) (default: what it trained on)", metavar="NAME")
    devices: int | None = cfg.field(
        None, "devices to use (default: all local; on CPU, 8 simulated)")
    backend: str = cfg.field(DEFAULT_BACKEND, "shard_map or pmap")
    batch_size: int = cfg.field(EVAL_BATCH, "global batch size")

    def check(self) -> None:
        cfg.whole(self, "devices")
        cfg.whole(self, "batch_size")
        check_backend(self.backend, 1)


def add_parser(sub) -> None:
    text = "evaluate a checkpoint on the eval split"
    add_flags(sub.add_parser(NAME, help=text, description=text[0].upper() + text[1:] + "."),
              EvalConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, EvalConfig))
    devices.start(config.devices)
    ev = evaluate_checkpoint(config.checkpoint, config.data, config.devices, config.backend,
                             config.batch_size)
    split = "" if config.data is None else f" (the eval split of {config.data})"
    print(f"{summary_line(ev)}  examples {ev['examples']}{split}")
    return 0


def evaluate_checkpoint(path: str, data: str | None = None, devices: int | None = None,
                        backend: str = DEFAULT_BACKEND, batch_size: int = EVAL_BATCH) -> dict:
    """Eval loss and accuracy of a checkpoint on the eval split of `data`
    (default: the data it was trained on)."""
    loaded = load_checkpoint(path, devices, backend)
    d = loaded.config.data
    # Text in the checkpoint's own tokens.
    ds = load(data or d.name, d.seq_len, d.x_column, d.y_column, d.tokenizer,
              loaded.tokenizer, packed=d.pack)
    _check_fits(ds, loaded.meta)
    return loaded.trainer.evaluate(ds.x_eval, ds.y_eval, batch_size)


def _check_fits(ds, meta: dict) -> None:
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
