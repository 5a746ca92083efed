"""Runs that survive a cluster: restarts from the newest checkpoint after a rank
dies, a watchdog instead of a hang when a rank stops, SIGUSR1 and `--resume
auto` for requeued jobs, joining a run from SLURM's or a Kubernetes Job's
environment, and checkpoints on a clock every rank agrees on. The reference
is always one uninterrupted process with as many devices."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from dpax.cli import main
from test_multiprocess import _children

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # starts dpax processes

RUN = ["--batch-size", "50", "--optimizer", "sgd", "--lr", "0.1", "--log-every", "5"]


def params(out) -> dict:
    with np.load(os.path.join(out, "params.npz")) as p:
        return {k: p[k] for k in p.files}


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in b)


def logged_steps(out) -> list[int]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r["step"] for r in rows if "loss" in r]


def reference(tmp_path, steps):
    """One process, 4 devices, uninterrupted: what 2 x 2 devices must give
    (trained once per step count; several tests compare with the same run)."""
    if steps not in _REFERENCES:
        out = str(tmp_path / "reference")
        assert main(["train", *RUN, "--steps", str(steps), "--devices", "4", "--out", out]) == 0
        _REFERENCES[steps] = params(out), logged_steps(out)
    return _REFERENCES[steps]


_REFERENCES: dict[int, tuple[dict, list[int]]] = {}


def start_launch(*args):
    cmd = [sys.executable, "-m", "dpax", "launch", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(p, lines, predicate, timeout=240):
    """Read the launch's output until a line satisfies `predicate`."""
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        lines.append((time.monotonic(), line))
        if predicate(line):
            return line
        assert time.monotonic() < deadline, "".join(ln for _, ln in lines)[-3000:]
    raise AssertionError("".join(ln for _, ln in lines)[-3000:])


def step_of(line: str) -> int | None:
    """The step of a rank-0 progress line (`[rank 0] step 25/80 ...`)."""
    words = line.split()
    if len(words) > 3 and words[2] == "step" and "/" in words[3]:
        return int(words[3].split("/")[0])
    return None


def rank_pid(launcher: int, rank: int) -> int:
    return next(pid for pid, cmd in _children(launcher).items()
                if f"--process-id {rank}" in cmd and " train " in cmd)


def test_a_killed_and_a_stopped_rank_restart_from_the_newest_checkpoint(tmp_path):
    """Two failures in one run: rank 1 killed (the launcher sees it die), then
    rank 1 stopped (SIGSTOP: alive but silent, so rank 0's watchdog must trip
    within --timeout). Each time every rank starts again from the newest
    checkpoint, and the run ends with the uninterrupted run's params, each
    step logged once."""
    steps, kill_at = 60, random.Random(7).randint(12, 22)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    p = start_launch("--nprocs", "2", "--devices-per-process", "2", "--max-restarts", "2",
                     "--", *RUN, "--steps", str(steps), "--checkpoint-dir", ck,
                     "--checkpoint-every", "10", "--timeout", "4", "--out", out)
    lines = []
    read_until(p, lines, lambda ln: (step_of(ln) or 0) >= kill_at)
    t0 = time.monotonic()
    os.kill(rank_pid(p.pid, 1), signal.SIGKILL)
    # Lost: from the kill until the restarted run passes the step it died at.
    read_until(p, lines, lambda ln: "dpax launch: restart" in ln)
    read_until(p, lines, lambda ln: (step_of(ln) or 0) > kill_at)
    lost = time.monotonic() - t0
    read_until(p, lines, lambda ln: (step_of(ln) or 0) >= 40)
    t0 = time.monotonic()
    os.kill(rank_pid(p.pid, 1), signal.SIGSTOP)
    stalled = read_until(p, lines, lambda ln: "stalled: waited" in ln)
    took = time.monotonic() - t0
    report = read_until(p, lines, lambda ln: ln.startswith("dpax launch: rank")
                        and "stalled" in ln)
    for line in p.stdout:
        lines.append((time.monotonic(), line))
    text = "".join(ln for _, ln in lines)
    assert p.wait(timeout=120) == 0, text[-3000:]
    assert text.count("dpax launch: rank 1 was killed by SIGKILL") == 1, text[-3000:]
    assert "restart 1 of 2" in text and "restart 2 of 2" in text
    after = text.split(stalled, 1)[1]
    print(f"killed at step {kill_at}: {lost:.1f}s lost to the restart; stalled after "
          f"{took:.1f}s; first lines:\n{stalled}{after[:400]}")
    assert took < 4 + 10
    assert "[rank 0] dpax: rank 0 stalled" in stalled
    assert "most recent call first" in after[:2000]  # faulthandler's stacks
    assert "rank 0 stalled" in report and "rank 1 is stopped" in report, report
    ref, ref_steps = reference(tmp_path, steps)
    assert max_diff(params(out), ref) == 0.0  # exact resume; 2 x 2 adds like 1 x 4
    assert logged_steps(out) == ref_steps  # every logged step once


def test_sigusr1_saves_exits_4_and_the_requeued_job_resumes(tmp_path):
    """What `sbatch --signal=USR1@90 --requeue` does: every rank gets SIGUSR1,
    they agree on a step, save and exit 4; the requeued job, given the same
    flags (`--resume auto`), continues there. Checkpoints are also taken on
    a clock: a save is collective, and if two ranks read their own clocks one
    would wait forever for the other's save; process 0's clock decides."""
    steps = 60
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    flags = [*RUN, "--steps", str(steps), "--checkpoint-dir", ck, "--resume", "auto",
             "--checkpoint-every-minutes", "0.001", "--keep", "100", "--out", out]
    p = start_launch("--nprocs", "2", "--devices-per-process", "2", "--", *flags)
    lines = []
    read_until(p, lines, lambda ln: (step_of(ln) or 0) >= 20)
    for rank in (0, 1):
        os.kill(rank_pid(p.pid, rank), signal.SIGUSR1)
    for line in p.stdout:
        lines.append((time.monotonic(), line))
    text = "".join(ln for _, ln in lines)
    assert p.wait(timeout=120) == 4, text[-3000:]
    assert "stopped by SIGUSR1 at step" in text
    saved = sorted(int(d) for d in os.listdir(ck) if d.isdigit())
    stopped = saved[-1]
    assert 20 <= stopped < steps
    again = subprocess.run([sys.executable, "-m", "dpax", "launch", "--nprocs", "2",
                            "--devices-per-process", "2", "--", *flags],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"resumed at step {stopped}" in again.stdout
    ref, ref_steps = reference(tmp_path, steps)
    print(f"SIGUSR1 at step {stopped}: exit 4; requeued run vs uninterrupted "
          f"{max_diff(params(out), ref):.2e}; saved at {saved}")
    assert max_diff(params(out), ref) == 0.0 and logged_steps(out) == ref_steps
    # On the clock: saves at log steps before the signal and after the resume, the last at the end.
    clock = sorted(int(d) for d in os.listdir(ck) if d.isdigit() and int(d) != stopped)
    assert len(clock) >= 3 and clock[-1] == steps, clock
    assert all(s % 5 == 0 for s in clock), clock


def _slurm_port() -> tuple[int, int]:
    """A SLURM job id whose coordinator port (JAX: id % 4096 + 61440) is free."""
    for job in random.Random().sample(range(100_000, 104_096), 50):
        port = job % 4096 + 61440
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job, port
    pytest.skip("no free port in SLURM's range")


def test_a_kubernetes_indexed_jobs_environment_names_the_run():
    """What a pod of the example JobSet sees; from there the run joins as the
    SLURM one below does (`distributed.environment_run` feeds both)."""
    from dpax.errors import DpaxError
    from dpax.parallel.distributed import environment_run

    env = {"JAX_COORDINATOR_ADDRESS": "job-0.svc:1234", "JAX_NUM_PROCESSES": "4"}
    assert environment_run({**env, "JOB_COMPLETION_INDEX": "2"}) == ("job-0.svc:1234", 4, 2)
    assert environment_run({**env, "JOB_COMPLETION_INDEX": "2", "JAX_PROCESS_ID": "3"})[2] == 3
    with pytest.raises(DpaxError, match="JOB_COMPLETION_INDEX"):
        environment_run(env)


def test_a_run_joins_from_slurms_environment(tmp_path):
    """Two processes given no multi-process flag, only SLURM's variables for
    one task per process, train as one process with all their devices. (A
    Kubernetes indexed Job's join the same way: the test above reads them.)"""
    steps = 10
    job, _ = _slurm_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                    "JAX_PROCESS_ID"))}
        env.update(SLURM_JOB_ID=str(job), SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank), SLURM_STEP_NODELIST="localhost",
                   SLURM_STEP_NUM_NODES="1")
        out = str(tmp_path / f"run{rank}")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dpax", "train", *RUN, "--steps", str(steps), "--devices",
             "2", "--out", out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "4 device(s)" in outs[0]  # both processes' devices, in one run
    assert not os.path.exists(tmp_path / "run1" / "params.npz")  # only process 0 writes
    ref, _ = reference(tmp_path, steps)
    diff = max_diff(params(tmp_path / "run0"), ref)
    print(f"SLURM environment, 2 processes x 2 devices vs 1 x 4: {diff:.2e}")
    assert diff == 0.0


def test_the_kubernetes_example_sets_what_dpax_reads():
    import pathlib

    import yaml

    from dpax.parallel import distributed

    root = pathlib.Path(__file__).parent.parent
    spec = yaml.safe_load((root / "examples" / "kubernetes-jobset.yaml").read_text())
    job = spec["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completionMode"] == "Indexed"  # each pod gets JOB_COMPLETION_INDEX
    container = job["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(distributed.K8S) <= set(env)
    assert env["JAX_NUM_PROCESSES"] == str(job["completions"])
    command = " ".join(container["command"])
    assert "--resume auto" in command and "--checkpoint-dir" in command
