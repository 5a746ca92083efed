"""The exceptions a user can act on, and how their messages name arguments.

Every exception dpax raises on purpose is a `DpaxError`: `except
dpax.DpaxError` catches exactly those. A plain `DpaxError` (and each kind
below that is not a `RuntimeError`) is bad input, refused before anything
runs; `RunFailed`, `TooManyBadSteps` and `Preempted` stop a run that started
(they are `RuntimeError`s too). Bad input is not a `ValueError`: the base
would have to be one, and a preemption is not a bad value.

A message names a Python argument in backticks, `name` or `name=value`, so the
Python API speaks Python; the CLI shows the same message with flags
(`dpax.cli.exits`).
"""

from __future__ import annotations


class DpaxError(Exception):
    """The base of every exception dpax raises on purpose; raised itself for
    bad input or environment, its message naming the problem and the fix."""


class PerDeviceState(DpaxError):
    """A model's state would be computed from each device's own rows by a
    layer dpax does not synchronize; `paths` names it (`dpax.training.step`)."""

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths


class PerDeviceRandom(DpaxError):
    """A model would draw the same random numbers for other examples on each
    device, from a key of its own (`dpax.training.step`)."""


class MixesExamples(DpaxError):
    """An example's loss would depend on the other examples a device holds
    (`dpax.analysis.rows`); `where` names the operation that mixes them."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


class ReadsBatchSize(DpaxError):
    """An example's loss would be computed from the number of rows a device
    holds, or from its position among them (`dpax.analysis.batch_size`);
    `where` names the operation."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


class BadArgument(DpaxError):
    """An argument no run can take, refused before the first step; `argument`
    names it (`batch_size`, `data`, `y`, `batches`, or the file it came from)."""

    def __init__(self, message: str, argument: str):
        super().__init__(message)
        self.argument = argument


class BadExamples(BadArgument):
    """Examples no step can train on: none, arrays of unequal lengths, not
    real numbers (`dpax.data.checks`); `key` is the array's key among the
    examples (`x`, `y`, ...), None when the fault is not one array's."""

    def __init__(self, message: str, argument: str, key: str | None = None):
        super().__init__(message, argument)
        self.key = key


class NotFinite(BadExamples):
    """NaN or infinite values in a float array: `rows` examples hold one,
    the `first` of them at that row."""

    def __init__(self, message: str, argument: str, key: str | None, rows: int, first: int):
        super().__init__(message, argument, key)
        self.rows, self.first = rows, first


class BadExamplesElsewhere(BadExamples):
    """Bad examples another process found in its rows of a first batch
    (each process checks only its own, and all of them stop together):
    `process` is the first that found some; its own error names them."""

    def __init__(self, message: str, argument: str, process: int):
        super().__init__(message, argument)
        self.process = process


class BadLabels(BadExamples):
    """Targets of a dtype, shape or range the loss that reads them cannot
    take (e.g. a class id the model has no output for)."""


class DpaxWarning(UserWarning):
    """Input that is legal but almost surely not what was meant (the CLI
    prints it as one `dpax: warning:` line)."""


class RunFailed(DpaxError, RuntimeError):
    """The run started and could not go on (e.g. a checkpoint could not be
    written); the message says what was kept."""


class TooManyBadSteps(DpaxError, RuntimeError):
    """Too many consecutive non-finite steps (`steps` of them, at most `limit`).

    What was found when they stopped: `loss_finite` (the loss logged since
    the last log; skipped steps log no loss, so then it is False where the
    last step's gradient norm is finite, which leaves the loss as what was
    not, and None where it is not), `gradient_finite` (the last step's
    gradient norm; None unless the step computes it: `skip_nonfinite=True`
    or `clip_norm`), `params_finite` (read then). `skipped`: whether the
    steps were skipped (the params are the last good ones) or applied."""

    def __init__(self, message: str, *, steps: int | None = None, limit: int | None = None,
                 skipped: bool | None = None, loss_finite: bool | None = None,
                 gradient_finite: bool | None = None, params_finite: bool | None = None):
        super().__init__(message)
        self.steps, self.limit, self.skipped = steps, limit, skipped
        self.loss_finite, self.gradient_finite = loss_finite, gradient_finite
        self.params_finite = params_finite


class Preempted(DpaxError, RuntimeError):
    """SIGTERM/SIGINT arrived; the run stopped at a step boundary after saving."""


def summary(error: BaseException, limit: int = 300) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else ""
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class FailsOnExamples(DpaxError):
    """The user's loss or model raised on a batch of the examples, as the
    training step was first traced; `where` names the user's line, and the
    error it raised is the `__cause__`."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


class NotPerExample(DpaxError):
    """`loss_fn` returned a value that is not one per example (a mean over the
    batch breaks exactness); `name` says which: "loss", "weight" or "metric
    NAME", and `shape` the shape it had (`()`: a mean)."""

    def __init__(self, message: str, name: str, shape: tuple = ()):
        super().__init__(message)
        self.name, self.shape = name, tuple(shape)
