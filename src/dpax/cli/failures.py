"""A failure on the terminal is one line; its whole story goes to a file.

While a run fails, the libraries under dpax tell it at length: Orbax logs an
error with its traceback from each background thread, asyncio logs the tasks
it dropped, JAX's runtime raises from deep inside a collective. The `dpax`
command keeps every log record (WARNING and up) and every exception of a
background thread (or printed by a library's C code) in memory instead of
printing them, and when the command fails writes them, after the failure's
own traceback, to `error.log` in the run directory (`error-rank{i}.log` for
the other processes of a run), or to a file in the temporary directory when
the command has no run directory. The terminal gets one line that names the
cause and that file. A warning without a traceback still shows, one line;
errors reported by a command that succeeded anyway are one warning line and
the file.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator

from dpax import __version__

MAX_RECORDS = 500  # the newest log records kept: a failure's own are the last ones
FILE = "error.log"


class _Keep(logging.Handler):
    """Keeps formatted log records (with their tracebacks) instead of printing
    them. A warning without a traceback (JAX's about a GPU it cannot use,
    say) still shows, as one line, once: it is about the run, not about a
    failure. `log.errors` counts the records of errors."""

    def __init__(self, log: FailureLog):
        super().__init__(logging.WARNING)
        self.log, self.shown = log, set()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.records.append(self.format(record))
            if record.levelno > logging.WARNING or record.exc_info:
                self.log.errors += 1
                return
            lines = record.getMessage().strip().splitlines()
            line = f"dpax: warning: {lines[0] if lines else ''}"
            if line not in self.shown:
                self.shown.add(line)
                print(line, file=sys.stderr, flush=True)
        except Exception:  # a record that cannot be formatted is not worth a crash
            self.handleError(record)


class FailureLog:
    """What a command's failure leaves for a bug report.

    Args:
      argv: the command line, written at the top of the file.
    """

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.records: collections.deque[str] = collections.deque(maxlen=MAX_RECORDS)
        self.run_dir: str | None = None  # set by a command once its run directory exists
        self.rank = 0
        self.errors = 0  # errors the libraries reported (logged, or a thread's exception)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[FailureLog]:
        """Log records and background threads' exceptions go to memory, not
        the terminal, for the duration of the block. The root logger gets
        this handler only: with none, absl's first record would install one
        that prints to stderr (`logging.basicConfig`)."""
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        hooks = threading.excepthook, sys.excepthook, sys.unraisablehook
        root.handlers = [_Keep(self)]
        root.setLevel(logging.WARNING)
        threading.excepthook = self._thread_failed
        # C code prints an exception its callback raised through sys.excepthook
        # (tensorstore's callbacks into Orbax's closed event loop: hundreds).
        sys.excepthook = self._printed
        sys.unraisablehook = self._unraisable
        try:
            yield self
        finally:
            root.handlers = handlers
            root.setLevel(level)
            threading.excepthook, sys.excepthook, sys.unraisablehook = hooks

    def _keep(self, what: str, exc_type, value, tb) -> None:
        text = "".join(traceback.format_exception(exc_type, value, tb))
        self.records.append(f"{what}:\n{text.rstrip()}")
        self.errors += 1

    def _thread_failed(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        self._keep(f"exception in thread {name}", args.exc_type, args.exc_value,
                   args.exc_traceback)

    def _printed(self, exc_type, value, tb) -> None:
        self._keep("exception printed by a library", exc_type, value, tb)

    def _unraisable(self, args) -> None:
        self._keep(f"exception ignored in {args.object!r}", args.exc_type, args.exc_value,
                   args.exc_traceback)

    def path(self) -> str:
        """Where the file goes: the run directory if there is one, else the
        temporary directory (with the time and process in its name)."""
        name = FILE if self.rank == 0 else f"error-rank{self.rank}.log"
        if self.run_dir is not None and os.path.isdir(self.run_dir):
            return os.path.join(self.run_dir, name)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return os.path.join(tempfile.gettempdir(), f"dpax-{stamp}-{os.getpid()}-{name}")

    def write(self, error: BaseException | None) -> str | None:
        """Write the failure's traceback (if any) and the kept records;
        returns the file's path (None if it could not be written: a full
        disk, say). Where the whole file does not fit (a disk nearly full, a
        file size limit), the failure's own traceback alone may."""
        path = self.path()
        lines = [f"dpax {__version__}, Python {sys.version.split()[0]}, "
                 f"{datetime.datetime.now().isoformat(timespec='seconds')}",
                 "command: dpax " + " ".join(self.argv), "",
                 "the command succeeded" if error is None else
                 "".join(traceback.format_exception(error)).rstrip()]
        records = [] if not self.records else [
            "", f"log records and background threads' exceptions "
                f"({len(self.records)}, oldest first):", *self.records]
        tries = [lines + records] + ([lines + ["", "(the log records did not fit)"]]
                                     if records else [])
        for text in tries:
            try:
                with open(path, "w") as f:
                    f.write("\n".join(text) + "\n")
                return path
            except OSError:
                continue
        return None


def report_errors(log: FailureLog) -> None:
    """After a command that succeeded: errors a library reported while it ran
    (a tracker's thread that died, say) are one warning line and a file."""
    if log.errors:
        path = log.write(None)
        where = f"; details in {path}" if path else ""
        print(f"dpax: warning: the libraries reported {log.errors} error(s) while the "
              f"command ran, which it got past{where}", file=sys.stderr, flush=True)


_current: FailureLog | None = None


def current() -> FailureLog | None:
    """The running command's log (None outside the `dpax` command)."""
    return _current


@contextlib.contextmanager
def installed(argv: list[str]) -> Iterator[FailureLog]:
    global _current
    log, previous = FailureLog(argv), _current
    _current = log
    try:
        with log.capturing():
            yield log
    finally:
        _current = previous
