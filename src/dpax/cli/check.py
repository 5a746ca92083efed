"""`dpax check`: does a model train on N devices exactly as on one? A few
steps on 1 and on N devices with an uneven batch, compared, with the likely
cause of a difference named."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import sys

from flax import linen, nnx

from dpax import config as cfg
from dpax.cli import devices
from dpax.cli.exits import as_flags
from dpax.cli.flags import add_flags, config_from_args
from dpax.data import text_shards
from dpax.data.datasets import check_name, is_text, load
from dpax.errors import DpaxError
from dpax.models import losses
from dpax.models.bridge import from_linen, takes
from dpax.models.registry import MODELS, TEXT_MODELS
from dpax.parallel.backends import DEFAULT_BACKEND, check_backend
from dpax.parallel.layout import SHARDINGS, check_sharding
from dpax.parallel.mesh import replica_count
from dpax.training.check import check_equivalence

NAME = "check"


@dataclasses.dataclass
class CheckConfig:
    """`dpax check`: train a few steps on 1 and on N devices and compare."""

    model: str = cfg.field("cnn-bn", "a built-in model")
    factory: str | None = cfg.field(
        None, "your model: FN(input_shape, n_out, rngs=nnx.Rngs) -> nnx.Module (or a Linen "
              "module, initialised on one example; its flag 'train', if it takes one)",
        metavar="MODULE:FN")
    loss: str | None = cfg.field(
        None, "your loss: FN(model, batch) -> per-example losses (default: the data's "
              "built-in loss)", metavar="MODULE:FN")
    data: str = cfg.field("digits", "data to train on")
    devices: int = cfg.field(8, "devices to compare with one")
    batch_size: int | None = cfg.field(None, "global batch (default: 5N+3, or 5N+2 on 3 "
                                             "devices, so a device holds padding)")
    steps: int = cfg.field(5, "SGD steps")
    grad_accum: int = cfg.field(1, "micro-batches per step, on both sides")
    backend: str = cfg.field(DEFAULT_BACKEND, "shard_map or pmap")
    sharding: str = cfg.field("replicated", "where the state lives on N devices: replicated, "
                              "optimizer (ZeRO-1) or full (FSDP)")
    replicas: str | int = cfg.field(1, "hybrid sharding's groups on N devices (a divisor of "
                                    "N)", metavar="R")
    sync_batchnorm: bool = cfg.field(
        True, "BatchNorm statistics over the global batch (--no-sync-batchnorm shows the "
              "difference per-device statistics make)")

    def check(self) -> None:
        for name in ("devices", "steps", "batch_size", "grad_accum"):
            cfg.whole(self, name)
        check_backend(self.backend, 1)
        cfg.one_of(self, "sharding", SHARDINGS)
        check_sharding(self.sharding, self.backend)
        self.replicas = replica_count(int(self.replicas) if str(self.replicas).isdigit()
                                      else self.replicas, self.devices, 1)
        if self.factory is None:
            cfg.one_of(self, "model", MODELS)
        check_name(self.data)
        if self.factory is None and (self.model in TEXT_MODELS) != is_text(self.data):
            raise DpaxError(f"--model {self.model} does not fit --data {self.data}; "
                            f"{' and '.join(TEXT_MODELS)} train on --data text, text:PATH or the "
                            "text shards of dpax prepare, the others on the rest")


def add_parser(sub) -> None:
    add_flags(sub.add_parser(
        NAME, help="does a model train on N devices exactly as on one?",
        description="Train a few steps on 1 and on N devices with an uneven batch, compare, "
                    "and name the likely cause of a difference. Exit 0: equivalent, 1: not."),
        CheckConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, CheckConfig))
    factory = _load(config.factory, "--factory") if config.factory else MODELS[config.model]
    user_loss = _load(config.loss, "--loss") if config.loss else None
    devices.start(config.devices)
    prepared = text_shards.describe(config.data)  # its windows as they were cut
    ds = load(config.data) if prepared is None else load(
        config.data, prepared["seq_len"], tokenizer_spec=prepared["tokenizer"],
        packed=prepared["packed"])
    loss_fn = user_loss or losses.for_task(ds.task)[0]
    try:
        inspect.signature(factory).bind(ds.input_shape, ds.n_out, rngs=None)
    except TypeError as e:
        raise DpaxError(f"--factory {config.factory} cannot be called as "
                        f"FN(input_shape, n_out, rngs=nnx.Rngs): {e}") from None
    except ValueError:  # no signature to inspect (a builtin): let the call say
        pass

    def make_model():
        model = factory(ds.input_shape, ds.n_out, rngs=nnx.Rngs(0))
        if isinstance(model, linen.Module):  # Linen: initialised on one example
            return from_linen(model, ds.x_train[:1],
                              train_kwarg="train" if takes(model, "train") else None)
        return model

    result = check_equivalence(
        make_model, loss_fn, ds.x_train, ds.y_train, devices=config.devices,
        batch_size=config.batch_size, steps=config.steps,
        sync_batchnorm=config.sync_batchnorm, backend=config.backend,
        grad_accum=config.grad_accum, sharding=config.sharding, replicas=config.replicas)
    print(as_flags(result.report()))
    return 0 if result.equivalent else 1


def _load(spec: str, what: str):
    """`module:attribute` -> the attribute (the current directory is importable)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        example = {"--loss": "mylosses:my_loss"}.get(what, "mymodels:make_model")
        raise DpaxError(f"{what} {spec!r} is not MODULE:NAME, e.g. {example}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        obj = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise DpaxError(f"cannot import {module!r} for {what}: {e}") from None
    except AttributeError:
        raise DpaxError(f"module {module!r} has no {name!r} for {what}") from None
    if not callable(obj):
        raise DpaxError(f"{what} {spec!r} is not callable")
    return obj
