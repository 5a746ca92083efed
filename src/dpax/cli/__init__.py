"""The `dpax` command: a thin shell over `dpax.cli.run.train` and friends.

Flags are derived from `TrainConfig`, so defaults and help live in one place.
Bad input exits 2 with one line on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import typing
import warnings

from dpax.cli.config import (
    RENAMED,
    BenchConfig,
    CheckConfig,
    EvalConfig,
    PredictConfig,
    SampleConfig,
    TrainConfig,
    field_types,
)
from dpax.errors import DpaxError, DpaxWarning, Preempted, RunFailed, TooManyBadSteps, as_flags

EXIT_FAILED = 1  # the run started and could not go on; what was kept is said
EXIT_USAGE = 2  # bad input: nothing ran
EXIT_BAD_STEPS = 3  # too many non-finite steps in a row; last good params saved
EXIT_PREEMPTED = 4  # SIGTERM/SIGINT: stopped at a step boundary, checkpoint saved


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        # argparse prints the whole usage block; one line that names the fix is kinder.
        self.exit(EXIT_USAGE, f"dpax: error: {message} (see '{self.prog} -h')\n")


def add_config_flags(parser: argparse.ArgumentParser, cls=TrainConfig) -> None:
    """One `--flag` per dataclass field, with the field's default and help."""
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = types[f.name][0]
        meta = f.metadata
        helptext = meta.get("help", "")
        if f.default is not None:
            helptext += f" (default: {f.default})"
        # default=None everywhere: an unset flag leaves the dataclass default in charge.
        if "nargs" in meta:  # e.g. --resume [PATH]
            parser.add_argument(flag, nargs=meta["nargs"], const=meta["const"],
                                default=None, metavar="PATH", help=helptext)
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=helptext)
        else:
            metavar = meta.get("metavar") or {int: "N", float: "X"}.get(tp, "NAME")
            parser.add_argument(flag, type=tp, default=None, metavar=metavar, help=helptext,
                                required=meta.get("required", False))


def config_from_args(args: argparse.Namespace, cls=TrainConfig):
    """Defaults < the --config YAML file (train) < flags given on the command line."""
    fields = cls.yaml_fields(args.config) if getattr(args, "config", None) else {}
    fields.update({f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                   if getattr(args, f.name) is not None})
    try:
        return cls(**fields)
    except TypeError as e:
        raise DpaxError(f"bad config: {e}") from None


def flags_markdown(cls=TrainConfig) -> str:
    """The `dpax train` flag table for the README, from the dataclass itself."""
    lines = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = "" if f.default is None else f"`{f.default}`"
        lines.append(f"| `--{f.name.replace('_', '-')}` | {default} | {f.metadata['help']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpax", description="Data-parallel training on JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train a model data-parallel",
                           description="Train a model data-parallel on N devices.")
    train.add_argument("--config", metavar="FILE.yaml",
                       help="load a config (e.g. a run's config.yaml); flags override it")
    add_config_flags(train)
    sub.add_parser("devices", help="print the devices JAX sees")
    bench = sub.add_parser("bench", help="dpax vs hand-written pmap and jit loops",
                           description=BenchConfig.__doc__.split(": ", 1)[1])
    add_config_flags(bench, BenchConfig)
    check = sub.add_parser(
        "check", help="does a model train on N devices exactly as on one?",
        description="Train a few steps on 1 and on N devices with an uneven batch, compare, "
                    "and name the likely cause of a difference. Exit 0: equivalent, 1: not.")
    add_config_flags(check, CheckConfig)
    plot = sub.add_parser("plot", help="PNG plots of runs' metrics, overlaid",
                          description="Plot loss, accuracy, LR and steps/s of one or more runs.")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories from --out")
    plot.add_argument("--out", default=None, metavar="FILE.png",
                      help="where to write (default: next to the runs)")
    for name, cls, text in (
            ("eval", EvalConfig, "evaluate a checkpoint on the eval split"),
            ("predict", PredictConfig, "predict every row of an .npz with a checkpoint")):
        add_config_flags(sub.add_parser(name, help=text,
                                        description=text[0].upper() + text[1:] + "."), cls)
    add_config_flags(sub.add_parser(
        "sample", help="continue a prompt with a trained language model",
        description="Print a language model's continuation of --prompt (dpax train "
                    "--model gpt --data text makes one)."), SampleConfig)
    prep = sub.add_parser(
        "prepare", help="write examples as ArrayRecord shards to stream with --data",
        description="Convert an .npz, Parquet file(s) or a saved Hugging Face dataset to "
                    "ArrayRecord shards in DEST (a new directory), read per batch by "
                    "dpax train --data DEST.")
    prep.add_argument("src", metavar="SRC", help=".npz, Parquet file or directory, or a "
                      "datasets.save_to_disk directory")
    prep.add_argument("dest", metavar="DEST", help="new directory for the shards")
    prep.add_argument("--x-column", default="x", help="column of inputs (default: x)")
    prep.add_argument("--y-column", default="y", help="column of labels (default: y)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    launch = sub.add_parser(
        "launch", help="run `dpax train` as several local processes",
        description="Start P processes of one multi-process run: "
                    "dpax launch --nprocs 2 --devices-per-process 2 -- --steps 100")
    launch.add_argument("--nprocs", type=int, required=True, metavar="P",
                        help="number of processes")
    launch.add_argument("--devices-per-process", type=int, default=None, metavar="D",
                        help="devices per process (default: all local; on CPU, 8 simulated)")
    launch.add_argument("--port", type=int, default=None,
                        help="coordinator port (default: a free one)")
    launch.add_argument("--verbose", action="store_true",
                        help="show every rank's output, not only rank 0's")
    launch.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then the flags of dpax train")
    parser.commands = sub.choices  # name -> subparser, for errors that name the command
    return parser


def _start_devices(config: TrainConfig | None = None) -> None:
    """Simulated CPU devices and the multi-process runtime, before JAX starts.

    On CPU hosts a single process gets 8 simulated devices (or --devices of
    them, a subset used); each process of a multi-process run gets exactly
    --devices. Accelerators are unaffected.
    """
    from dpax.parallel.distributed import initialize
    from dpax.parallel.mesh import simulate_devices

    config = config or TrainConfig()
    if (config.num_processes or 1) > 1:
        simulate_devices(config.devices or 8)
    else:
        simulate_devices(max(config.devices or 8, 8))
    initialize(config.coordinator, config.num_processes, config.process_id,
               timeout=config.timeout)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """dpax's warnings as one `dpax: warning:` line; others as Python shows them."""
    if issubclass(category, DpaxWarning):
        print(f"dpax: warning: {as_flags(str(message))}", file=file or sys.stderr, flush=True)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():  # restored for a caller that runs main() in-process
        warnings.simplefilter("always", DpaxWarning)
        warnings.showwarning = _show_warning
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    for old, new in RENAMED.items():
        flag = "--" + old.replace("_", "-")
        if flag in extra:
            parser.commands[args.command].error(
                f"{flag} is now --{new.replace('_', '-').replace(':', '')}")
    if extra:  # named by the subcommand, whose -h lists what it takes
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "devices":
            _start_devices()
            from dpax.parallel.mesh import describe

            print(describe())
            return 0
        if args.command == "launch":
            from dpax.cli.launch import launch

            train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
            return launch(train_args, args.nprocs, args.devices_per_process, args.port,
                          args.verbose)
        if args.command == "prepare":
            from dpax.data.prepare import prepare

            meta = prepare(args.src, args.dest, args.x_column, args.y_column,
                           progress=not args.quiet)
            print(f"wrote {meta['examples']} examples in {len(meta['shards'])} shard(s) "
                  f"to {args.dest}")
            return 0
        if args.command == "check":
            return _check(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "plot":
            from dpax.cli.plot import plot_runs

            print(f"wrote {plot_runs(args.run_dirs, args.out)}")
            return 0
        if args.command == "sample":
            return _sample(args)
        if args.command in ("eval", "predict"):
            return _checkpoint_command(args)
        config = config_from_args(args)
        config.validate()
        _start_devices(config)
        from dpax.cli.run import train

        train(config)
        return 0
    except DpaxError as e:
        print(f"dpax: error: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as e:
        print(f"dpax: error: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_FAILED
    except Preempted as e:
        print(f"dpax: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_PREEMPTED
    except TooManyBadSteps as e:
        print(f"dpax: stopped: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_BAD_STEPS
    except KeyboardInterrupt:
        print("dpax: interrupted", file=sys.stderr)
        return 130


def _load(spec: str, what: str):
    """`module:attribute` -> the attribute (the current directory is importable)."""
    import importlib

    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise DpaxError(f"{what} {spec!r} is not MODULE:NAME, e.g. mymodels:make_model")
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


def _check(args) -> int:
    from dpax import data as data_mod
    from dpax import models
    from dpax.models import losses

    config = config_from_args(args, CheckConfig)
    config.validate()
    factory = _load(config.factory, "--factory") if config.factory else models.MODELS[config.model]
    user_loss = _load(config.loss, "--loss") if config.loss else None
    _start_devices(TrainConfig(devices=config.devices))
    from flax import linen, nnx

    from dpax.models.bridge import from_linen, takes
    from dpax.training.check import check_equivalence

    ds = data_mod.load(config.data)
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
        make_model, loss_fn,
        ds.x_train, ds.y_train, devices=config.devices, batch_size=config.batch_size,
        steps=config.steps, sync_batchnorm=config.sync_batchnorm, backend=config.backend)
    print(as_flags(result.report()))
    return 0 if result.equivalent else 1


def _bench(args) -> int:
    config = config_from_args(args, BenchConfig)
    config.validate()
    _start_devices(TrainConfig(devices=max(config.counts())))
    from dpax.bench import run_bench

    run_bench(config.names(), config.counts(), config.repeats, config.steps,
              config.steps_per_call, config.sweep, config.out, config.layouts(),
              optimizer=config.optimizer)
    print(f"wrote {config.out}/results.md")
    return 0


def _sample(args) -> int:
    config = config_from_args(args, SampleConfig)
    config.validate()
    _start_devices(TrainConfig(devices=1))
    from dpax.cli.sample import sample_checkpoint

    text = sample_checkpoint(config.checkpoint, config.prompt, config.tokens,
                             config.temperature, config.seed)
    print(config.prompt + text)
    return 0


def _checkpoint_command(args) -> int:
    config = config_from_args(args, EvalConfig if args.command == "eval" else PredictConfig)
    config.validate()
    _start_devices(TrainConfig(devices=config.devices))
    from dpax.cli import run

    if args.command == "eval":
        ev = run.evaluate_checkpoint(config.checkpoint, config.data, config.devices,
                                     config.backend, config.batch_size)
        print(f"{run.summary_line(ev)}  examples {ev['examples']}")
    else:
        preds = run.predict_checkpoint(config.checkpoint, config.data, config.out,
                                       config.devices, config.backend, config.batch_size)
        print(f"wrote {len(preds)} predictions to {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
