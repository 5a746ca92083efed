"""`dpax launch`: P local processes of one `dpax train` run on JAX's runtime.

Each rank gets a free coordinator port and its `--process-id`; its output lines
come back prefixed with `[rank i]` (rank 0's stdout only, unless verbose; every
rank's stderr). When one rank fails the others are stopped, so nothing hangs,
and the launcher says which rank failed first and why. With `--max-restarts
K` a failed run (a rank killed, crashed or stalled) is started again, every
rank, from the newest checkpoint, up to K times; a run that stopped on
purpose (done, bad input, too many bad steps, a signal) is not.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing

from dpax import config as cfg
from dpax.cli import outputs, train
from dpax.cli.exits import (
    EXIT_BAD_STEPS,
    EXIT_PREEMPTED,
    EXIT_STALLED,
    EXIT_USAGE,
    OneLineParser,
)
from dpax.cli.flags import config_from_args
from dpax.cli.job import TrainConfig
from dpax.errors import DpaxError

NAME = "launch"
_LAUNCH_FLAGS = ("--nprocs", "--devices-per-process", "--port", "--max-restarts", "--verbose")
GRACE_S = 5  # SIGTERM, then SIGKILL after this long
LAST_WORDS_S = 2  # how long a failed rank's output may take to drain
# Exit codes of a run that stopped on purpose: starting it again changes nothing.
NO_RESTART = (0, EXIT_USAGE, EXIT_BAD_STEPS, EXIT_PREEMPTED, 130)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        NAME, help="run `dpax train` as several local processes",
        description="Start P processes of one multi-process run: "
                    "dpax launch --nprocs 2 --devices-per-process 2 -- --steps 100")
    parser.add_argument("--nprocs", type=int, required=True, metavar="P",
                        help="number of processes")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="D",
                        help="devices per process (default: all local; on CPU, 8 simulated)")
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port (default: a free one)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="start a failed run again from its newest checkpoint, up to K "
                             "times (needs --checkpoint-dir among the train flags)")
    parser.add_argument("--verbose", action="store_true",
                        help="show every rank's output, not only rank 0's")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then the flags of dpax train")


def run(args: argparse.Namespace) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return launch(train_args, args.nprocs, args.devices_per_process, args.port, args.verbose,
                  max_restarts=args.max_restarts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # a signal -N reads as 128+N, like a shell


def _describe(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    if rc == EXIT_STALLED:
        return "stalled (it waited on its peers longer than --timeout)"
    return f"exited with code {rc}"


class Muted:
    """The ranks whose output no longer shows (once another rank failed: it
    is about losing that rank); what they print goes to a file each, in a
    temporary directory made when the first line comes."""

    def __init__(self):
        self.ranks: set[int] = set()
        self.dir: str | None = None
        self._files: dict[int, typing.TextIO] = {}
        self._lock = threading.Lock()  # one pump thread per stream
        self._closed = False

    def write(self, rank: int, line: str) -> None:
        with self._lock:
            if self._closed:  # a pump that outlived the launcher's wait for it
                return
            if rank not in self._files:
                self.dir = self.dir or tempfile.mkdtemp(prefix="dpax-launch-")
                self._files[rank] = open(os.path.join(self.dir, f"rank{rank}.log"), "a")
            self._files[rank].write(line)

    def close(self) -> str | None:
        """Close the files; returns their directory (None if nothing came)."""
        with self._lock:
            self._closed = True
            for f in self._files.values():
                f.close()
            return self.dir


def _pump(stream, rank: int, show, out, muted: Muted) -> None:
    for line in stream:
        if rank in muted.ranks:
            muted.write(rank, line)
        elif show(line):
            out.write(f"[rank {rank}] {line}")
            out.flush()
    stream.close()


def _flag_given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def resuming(train_args: list[str]) -> list[str]:
    """The train flags of a restart: `--resume auto` instead of any `--resume
    [PATH]` or `--overwrite` (a restart continues the run it restarts)."""
    out, skip = [], False
    for i, a in enumerate(train_args):
        if skip:
            skip = False
            continue
        if a == "--overwrite" or a.startswith("--resume="):
            continue
        if a == "--resume":
            nxt = train_args[i + 1] if i + 1 < len(train_args) else "-"
            skip = not nxt.startswith("-")  # its optional PATH
            continue
        out.append(a)
    return [*out, "--resume", "auto"]


def launch(train_args: list[str], nprocs: int, devices_per_process: int | None = None,
           port: int | None = None, verbose: bool = False, out=sys.stdout,
           max_restarts: int = 0) -> int:
    """Run `dpax train TRAIN_ARGS` as `nprocs` processes, started again from
    the newest checkpoint up to `max_restarts` times when it fails; returns
    the exit code."""
    if nprocs < 1:
        raise DpaxError(f"`nprocs` must be >= 1, got {nprocs}")
    if devices_per_process is not None and devices_per_process < 1:
        raise DpaxError(f"`devices_per_process` must be >= 1, got {devices_per_process}")
    if port is not None and not 0 < port < 65536:
        raise DpaxError(f"`port` must be in 1..65535, got {port}")
    if max_restarts < 0:
        raise DpaxError(f"`max_restarts` must be >= 0, got {max_restarts}")
    if max_restarts and not _flag_given(train_args, "--checkpoint-dir"):
        raise DpaxError("`max_restarts` needs --checkpoint-dir among the train flags: a "
                        "restart continues from the newest checkpoint")
    taken = {"--coordinator", "--num-processes", "--process-id", "--devices"}
    clash = taken & {a.split("=")[0] for a in train_args}
    if clash:
        raise DpaxError(f"dpax launch sets {', '.join(sorted(clash))} itself; "
                        "use --devices-per-process for the device count")
    _check_train_flags(train_args, nprocs, devices_per_process)
    args = train_args
    for attempt in range(max_restarts + 1):
        code = _launch_once(args, nprocs, devices_per_process, port or free_port(), verbose,
                            out)
        if code in NO_RESTART or attempt == max_restarts:
            return code
        out.write(f"dpax launch: restart {attempt + 1} of {max_restarts}: every rank starts "
                  "again from the newest checkpoint\n")
        out.flush()
        args, port = resuming(train_args), None  # a fresh port: the old one may linger
    return code


def _check_train_flags(train_args: list[str], nprocs: int,
                       devices_per_process: int | None) -> None:
    """Refuse here, once, the train flags every rank would refuse (each rank
    printed the same line, after starting JAX): those no parser takes (exit
    2, as `dpax train` does), values `dpax train` refuses, and an `--out`
    that holds another run."""
    own = ["--coordinator", "localhost:1", "--num-processes", str(nprocs), "--process-id", "0"]
    if devices_per_process is not None:
        own += ["--devices", str(devices_per_process)]
    parser = OneLineParser(prog="dpax")
    commands = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    train.add_parser(commands)
    args, extra = parser.parse_known_args(["train", *train_args, *own])
    mine = [a for a in extra if a.split("=")[0] in _LAUNCH_FLAGS]
    if mine:
        raise DpaxError(f"{', '.join(mine)} is dpax launch's own: give it before `--`")
    if extra:
        commands.choices["train"].error(f"unrecognized arguments: {' '.join(extra)}")
    config = cfg.validate(config_from_args(args, TrainConfig))
    outputs.refuse_another_run(config.output, config.checkpoint)


def _launch_once(train_args, nprocs, devices_per_process, port, verbose, out) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    pumps: list[list[threading.Thread]] = []  # per rank: its stdout's and stderr's
    muted = Muted()
    for rank in range(nprocs):
        cmd = [sys.executable, "-m", "dpax", "train", *train_args,
               "--coordinator", f"localhost:{port}", "--num-processes", str(nprocs),
               "--process-id", str(rank)]
        if devices_per_process is not None:
            cmd += ["--devices", str(devices_per_process)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, start_new_session=True)
        procs.append(p)
        # gloo greets every peer; that is noise unless asked for.
        quiet = (lambda line: True) if verbose else (lambda line: "[Gloo]" not in line)
        show_out = quiet if (rank == 0 or verbose) else (lambda line: False)
        show_err = quiet
        pumps.append([])
        for stream, show in ((p.stdout, show_out), (p.stderr, show_err)):
            t = threading.Thread(target=_pump, args=(stream, rank, show, out, muted),
                                 daemon=True)
            t.start()
            pumps[rank].append(t)
    # A signal to the launcher (a scheduler's SIGTERM or SIGUSR1) goes to every
    # rank: they agree on a step, save and stop (exit 4).
    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)
           if main_thread}
    try:
        code = _wait(procs, out, pumps, muted)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    for t in (t for rank in pumps for t in rank):
        t.join(timeout=GRACE_S)
    kept = muted.close()
    if kept:
        out.write(f"dpax launch: what the other ranks printed since is in {kept}\n")
        out.flush()
    return code


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): it cannot answer."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _wait(procs: list[subprocess.Popen], out, pumps: list[list[threading.Thread]],
          muted: Muted) -> int:
    """The run's exit code, once every rank exited (0, or 4 when they stopped
    on a signal after saving), or at the first rank that failed (the others
    are then killed: a save needs every rank, so theirs cannot finish). Once
    a rank failed, only its own last words show: the others' are about
    losing it, and go to `muted`'s files."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, EXIT_PREEMPTED)]
            if failed:
                # A dead rank makes its peers abort inside a collective (SIGABRT)
                # or stall; name the rank that did neither.
                rank, rc = min(failed, key=lambda f: (f[1] in (-signal.SIGABRT, EXIT_STALLED),
                                                      f[0]))
                muted.ranks.update(r for r in range(len(procs)) if r != rank)
                stopped = [r for r, p in enumerate(procs) if codes[r] is None and _stopped(p.pid)]
                # Its last words first (a stalled rank's stacks), then the verdict:
                # written at once, the verdict could come before them.
                for t in pumps[rank]:
                    t.join(timeout=LAST_WORDS_S)
                why = f"rank {rank} {_describe(rc)}"
                if stopped:  # the peers stalled waiting on a rank that cannot run
                    why += (f"; rank {', '.join(map(str, stopped))} is stopped (SIGSTOP?) "
                            "and stalled the others")
                out.write(f"dpax launch: {why}; stopping the other ranks\n")
                out.flush()
                _stop(procs, at_once=True)
                return _exit_code(rc)
            if all(c is not None for c in codes):
                return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen], at_once: bool = False) -> None:
    """SIGTERM every live rank's process group (they save and stop), SIGKILL
    what is left after GRACE_S; `at_once`: SIGKILL only (after a rank failed
    the others cannot save: a save needs every rank)."""
    steps = ((signal.SIGKILL, GRACE_S),) if at_once else (
        (signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S))
    for sig, wait in steps:
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
