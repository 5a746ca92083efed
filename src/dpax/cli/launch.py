"""`dpax launch`: P local processes of one `dpax train` run on JAX's runtime.

Each rank gets a free coordinator port and its `--process-id`; its output lines
come back prefixed with `[rank i]` (rank 0's stdout only, unless verbose; every
rank's stderr). When one rank fails the others are stopped, so nothing hangs,
and the launcher returns the first failure's exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from dpax.errors import DpaxError

NAME = "launch"


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
    parser.add_argument("--verbose", action="store_true",
                        help="show every rank's output, not only rank 0's")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then the flags of dpax train")


def run(args: argparse.Namespace) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return launch(train_args, args.nprocs, args.devices_per_process, args.port, args.verbose)

GRACE_S = 5  # SIGTERM, then SIGKILL after this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # a signal -N reads as 128+N, like a shell


def _describe(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def _pump(stream, rank: int, show, out) -> None:
    for line in stream:
        if show(line):
            out.write(f"[rank {rank}] {line}")
            out.flush()
    stream.close()


def launch(train_args: list[str], nprocs: int, devices_per_process: int | None = None,
           port: int | None = None, verbose: bool = False, out=sys.stdout) -> int:
    """Run `dpax train TRAIN_ARGS` as `nprocs` processes; returns the exit code."""
    if nprocs < 1:
        raise DpaxError(f"`nprocs` must be >= 1, got {nprocs}")
    if devices_per_process is not None and devices_per_process < 1:
        raise DpaxError(f"`devices_per_process` must be >= 1, got {devices_per_process}")
    if port is not None and not 0 < port < 65536:
        raise DpaxError(f"`port` must be in 1..65535, got {port}")
    taken = {"--coordinator", "--num-processes", "--process-id", "--devices"}
    clash = taken & {a.split("=")[0] for a in train_args}
    if clash:
        raise DpaxError(f"dpax launch sets {', '.join(sorted(clash))} itself; "
                        "use --devices-per-process for the device count")
    port = port or free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
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
        for stream, show in ((p.stdout, show_out), (p.stderr, show_err)):
            t = threading.Thread(target=_pump, args=(stream, rank, show, out), daemon=True)
            t.start()
            pumps.append(t)
    code = _wait(procs, out)
    for t in pumps:
        t.join(timeout=GRACE_S)
    return code


def _wait(procs: list[subprocess.Popen], out) -> int:
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A dead rank makes its peers abort inside a collective (SIGABRT)
                # within milliseconds; name the rank that did not abort.
                rank, rc = min(failed, key=lambda f: (f[1] == -signal.SIGABRT, f[0]))
                out.write(f"dpax launch: rank {rank} {_describe(rc)}; stopping the other ranks\n")
                out.flush()
                _stop(procs)
                return _exit_code(rc)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank's process group, SIGKILL what is left after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
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
