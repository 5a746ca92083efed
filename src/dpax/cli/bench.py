"""`dpax bench`: dpax against hand-written pmap and jit loops (`dpax.bench`)."""

from __future__ import annotations

import argparse

from dpax import config as cfg
from dpax.bench.run import BenchConfig, run_bench
from dpax.cli import devices
from dpax.cli.flags import add_flags, config_from_args
from dpax.parallel import compile_cache

NAME = "bench"


def add_parser(sub) -> None:
    add_flags(sub.add_parser(NAME, help="dpax vs hand-written pmap and jit loops",
                             description=BenchConfig.__doc__.split(": ", 1)[1]), BenchConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, BenchConfig))
    devices.start(max(config.counts()))
    # Every method's first call (the table's compile column) compiles afresh.
    with compile_cache.off():
        run_bench(config.names(), config.counts(), config.repeats, config.steps,
                  config.steps_per_call, config.sweep, config.out, config.layouts(),
                  optimizer=config.optimizer)
    print(f"wrote {config.out}/results.md")
    return 0
