"""The `dpax` command: `main`, its parser made of every command module's,
and the exit code of each kind of failure. Bad input exits 2 with one line
on stderr and no traceback; any other failure is one line too, its traceback
and the libraries' log records in a file (`dpax.cli.failures`)."""

from __future__ import annotations

import argparse
import sys
import warnings

from dpax.cli import (
    bench,
    check,
    devices,
    estimate,
    evaluate,
    export,
    failures,
    launch,
    plot,
    predict,
    prepare,
    sample,
    train,
)
from dpax.cli.exits import (
    EXIT_BAD_STEPS,
    EXIT_FAILED,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    OneLineParser,
    as_flags,
)
from dpax.errors import (
    DpaxError,
    DpaxWarning,
    Preempted,
    RunFailed,
    TooManyBadSteps,
    summary,
)
from dpax.machine import versions

COMMANDS = (train, evaluate, predict, sample, export, check, estimate, bench, plot, prepare,
            launch, devices)



def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dpax", description="Data-parallel training on JAX.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print dpax's version and its stack's, and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in COMMANDS:
        command.add_parser(sub)
    parser.commands = sub.choices  # name -> subparser, for errors that name the command
    return parser


class _Version(argparse.Action):
    """`dpax.machine.versions()`; argparse's own version action wraps the
    line at the terminal's width."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit(0)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """dpax's warnings as one `dpax: warning:` line; others as Python shows them."""
    if issubclass(category, DpaxWarning):
        print(f"dpax: warning: {as_flags(str(message))}", file=file or sys.stderr, flush=True)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with warnings.catch_warnings():  # restored for a caller that runs main() in-process
        warnings.simplefilter("always", DpaxWarning)
        warnings.showwarning = _show_warning
        with failures.installed(argv) as log:
            return _main(argv, log)


def _main(argv: list[str], log: failures.FailureLog) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand, whose -h lists what it takes
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    command = next(c for c in COMMANDS if c.NAME == args.command)
    try:
        code = command.run(args)
        failures.report_errors(log)
        return code
    except RunFailed as e:
        print(f"dpax: error: {as_flags(str(e))}{_details(log, e)}", file=sys.stderr)
        return EXIT_FAILED
    except Preempted as e:
        print(f"dpax: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_PREEMPTED
    except TooManyBadSteps as e:
        print(f"dpax: stopped: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_BAD_STEPS
    except DpaxError as e:  # after the kinds above: any other is bad input
        print(f"dpax: error: {as_flags(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dpax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the runtime, the disk, the network, or a bug of dpax's
        print(f"dpax: error: {summary(e)}{_details(log, e)}", file=sys.stderr)
        return EXIT_FAILED


def _details(log: failures.FailureLog, error: BaseException) -> str:
    path = log.write(error)
    return f" (details in {path})" if path else ""


if __name__ == "__main__":
    sys.exit(main())
