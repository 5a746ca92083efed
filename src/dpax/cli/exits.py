"""The `dpax` command's exit codes, and its messages in flags.

The library's messages name Python arguments in backticks, `name` or
`name=value`; the command shows the same message with flags (`--name`,
`--name value`, `--no-name` for `name=False`). A `DpaxError` is
one stderr line: `RunFailed` exits 1, `TooManyBadSteps` 3, `Preempted` 4,
any other (bad input) 2; anything else is a bug and keeps its traceback (in a file:
`dpax.cli.failures`).
"""

from __future__ import annotations

import argparse
import re
import typing

# docs/cli.md lists them.
EXIT_FAILED = 1  # the run started and could not go on; what was kept is said
EXIT_USAGE = 2  # bad input: nothing ran
EXIT_BAD_STEPS = 3  # too many non-finite steps in a row; last good params saved
EXIT_PREEMPTED = 4  # SIGTERM/SIGINT/SIGUSR1: stopped at a step boundary, checkpoint saved
EXIT_STALLED = 5  # a rank waited on its peers longer than --timeout (stacks printed)

_ARG = re.compile(r"`([a-z_][a-z0-9_]*)(?:=([^`]*))?`")
# Arguments whose flag is not their name: `dpax check --loss MODULE:FN`.
_FLAG_NAMES = {"loss_fn": "loss"}


def as_flags(message: str) -> str:
    """`message` with its `name` / `name=value` arguments written as flags."""
    def flag(m: re.Match) -> str:
        name, value = _FLAG_NAMES.get(m.group(1), m.group(1)).replace("_", "-"), m.group(2)
        if value is None:
            return f"--{name}"
        if value == "True":
            return f"--{name}"
        if value == "False":
            return f"--no-{name}"
        return f"--{name} {value.strip(chr(39))}"

    return _ARG.sub(flag, message)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        # argparse prints the whole usage block; one line that names the fix is kinder.
        self.exit(EXIT_USAGE, f"dpax: error: {message} (see '{self.prog} -h')\n")
