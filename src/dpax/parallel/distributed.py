"""Joining JAX's multi-process runtime (`jax.distributed`), with clear errors.

One process per host, each owning its local devices; collectives span all of
them. A process joins from its arguments (`coordinator`, `num_processes`,
`process_id`: what `dpax launch` passes), or from its scheduler's
environment: SLURM (`SLURM_*`, read through JAX's own SLURM support) or a
Kubernetes Job (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, and
`JAX_PROCESS_ID` or an indexed Job's `JOB_COMPLETION_INDEX`).

JAX aborts the process (a C++ stack trace, no Python exception) when the
coordinator cannot be reached, so dpax checks the address from Python first
and turns a wrong one into a one-line error. Ranks that must act together on a
host-side decision (a time-based checkpoint, a signal) agree on it through a
tiny collective (`any_process`, `from_process_0`, `refuse_together`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from dpax import config as cfg
from dpax.errors import DpaxError
from dpax.parallel import watchdog

# A rank that waits on its peers this long is stalled (`dpax.parallel.watchdog`).
DEFAULT_TIMEOUT_S = 30
# How long process 0 waits for every rank to join: a cold cluster starts slowly.
DEFAULT_INIT_TIMEOUT_S = 300


@dataclasses.dataclass
class DistributedConfig:
    """Joining a multi-process run (`dpax launch` sets these; SLURM and
    Kubernetes environments need none)."""

    coordinator: str | None = cfg.field(
        None, "HOST:PORT of process 0, for multi-process runs (or use dpax launch)", how=True)
    num_processes: int | None = cfg.field(None, "processes in a multi-process run", how=True)
    process_id: int | None = cfg.field(None, "this process's rank, 0..num-processes-1",
                                       how=True)
    timeout: int = cfg.field(
        DEFAULT_TIMEOUT_S, "seconds a rank may wait on its peers before it prints its stacks "
        "and stops (the dpax command exits with code 5); a dead rank is declared after "
        "twice this", how=True)
    init_timeout: int = cfg.field(
        DEFAULT_INIT_TIMEOUT_S, "seconds to wait for every process to join the run", how=True)

    def check(self) -> None:
        check_args(self.coordinator, self.num_processes, self.process_id, self.timeout)
        cfg.whole(self, "init_timeout")

    @property
    def processes(self) -> int:
        return self.num_processes or 1

    def from_environment(self) -> DistributedConfig:
        """This config, or, when no flag names a run, the run the scheduler's
        environment describes (unchanged when there is none)."""
        if self.coordinator is not None:
            return self
        found = environment_run()
        if found is None:
            return self
        return dataclasses.replace(self, coordinator=found[0], num_processes=found[1],
                                   process_id=found[2])


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None,
               timeout: int) -> None:
    """The rules on joining a run, checked before anything starts."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise DpaxError("give `coordinator`, `num_processes` and `process_id` together")
    if timeout < 1:
        raise DpaxError(f"`timeout` must be >= 1 second, got {timeout}")
    if not any(given):
        return
    parse_address(coordinator)
    if num_processes < 1:
        raise DpaxError(f"`num_processes` must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DpaxError(f"`process_id` must be in [0, {num_processes}), got {process_id}")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DpaxError(f"`coordinator={address}` is not HOST:PORT (e.g. 10.0.0.1:1234)")
    return host.strip("[]"), int(port)


# -- the scheduler's environment ---------------------------------------------------------
K8S = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES")


def environment_run(environ=os.environ) -> tuple[str, int, int] | None:
    """(coordinator, processes, this process's rank) from a Kubernetes Job's
    or SLURM's environment, or None outside one."""
    if all(k in environ for k in K8S):
        rank = environ.get("JAX_PROCESS_ID", environ.get("JOB_COMPLETION_INDEX"))
        if rank is None:
            raise DpaxError("JAX_COORDINATOR_ADDRESS is set but neither JAX_PROCESS_ID nor "
                            "JOB_COMPLETION_INDEX (an indexed Job's) says this process's rank")
        return environ["JAX_COORDINATOR_ADDRESS"], int(environ["JAX_NUM_PROCESSES"]), int(rank)
    slurm = _slurm()
    if slurm is not None and slurm.is_env_present():
        # JAX's own reading of SLURM: the coordinator is the step's first node,
        # its port derived from the job id (JAX_COORDINATOR_PORT overrides it).
        address = slurm.get_coordinator_address(None, environ.get("JAX_COORDINATOR_PORT"))
        return address, slurm.get_process_count(), slurm.get_process_id()
    return None


def _other_cluster() -> bool:
    """Whether JAX detects a cluster dpax does not read itself (Open MPI, cloud
    TPU pods, ...): JAX then joins it on its own."""
    try:  # private, but exactly JAX's own list
        from jax._src import clusters
    except ImportError:
        return False
    return any(c.is_env_present() for c in clusters.ClusterEnv._cluster_types
               if c.__name__ not in ("Mpi4pyCluster", "SlurmCluster"))  # mpi4py is opt-in


def _slurm():
    try:  # private, but exactly JAX's own SLURM support
        from jax._src.clusters.slurm_cluster import SlurmCluster
    except ImportError:
        return None
    return SlurmCluster


def slurm_local_devices(environ=os.environ) -> list[int] | None:
    """The local GPUs one SLURM task may use. JAX gives each task only the GPU
    of its local rank (one task per GPU, jax-ml/jax#16788); with one task per
    node the task owns every GPU SLURM gave the node. None: leave it to JAX."""
    if "SLURM_JOB_ID" not in environ or "SLURM_GPUS_ON_NODE" not in environ:
        return None
    nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")))
    if int(environ.get("SLURM_NTASKS", "1")) != nodes:  # several tasks on a node
        return None
    return list(range(int(environ["SLURM_GPUS_ON_NODE"])))


# -- joining ---------------------------------------------------------------------------------
def _check_reachable(host: str, port: int, process_id: int, timeout: float) -> None:
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror:
        msg = f"coordinator host {host!r} does not resolve; check `coordinator`"
        raise DpaxError(msg) from None
    if process_id == 0:  # process 0 hosts the coordinator: the port must be free here
        with socket.socket() as s:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("", port))
            except OSError:
                raise DpaxError(f"coordinator port {port} is in use on this host; "
                                "pick another with `coordinator=HOST:PORT`") from None
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise DpaxError(
                    f"process {process_id} cannot reach the coordinator at {host}:{port} "
                    f"within {timeout:.0f}s; check `coordinator` (or `init_timeout`) and "
                    "that process 0 is running") from None
            time.sleep(0.5)


def initialize(config: DistributedConfig) -> None:
    """Join the multi-process run `config` names (its flags, or the
    scheduler's environment: `DistributedConfig.from_environment`) before
    anything touches the JAX backend; a single process joins nothing."""
    config = config.from_environment()
    check_args(config.coordinator, config.num_processes, config.process_id, config.timeout)
    if config.coordinator is None and _other_cluster():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(initialization_timeout=config.init_timeout,
                                   heartbeat_timeout_seconds=2 * config.timeout + 10)
        return
    if config.processes == 1:
        return
    host, port = parse_address(config.coordinator)
    _check_reachable(host, port, config.process_id, config.init_timeout)
    # CPU devices of different processes talk over gloo; GPUs and TPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A dead rank is declared after twice the stall timeout, so that a stalled
    # rank's watchdog speaks first (with Python stacks, not JAX's C++ abort).
    jax.distributed.initialize(f"{host}:{port}", config.num_processes, config.process_id,
                               local_device_ids=slurm_local_devices(),
                               initialization_timeout=config.init_timeout,
                               heartbeat_timeout_seconds=2 * config.timeout + 10)


def is_writer() -> bool:
    """Only process 0 writes run files."""
    return jax.process_index() == 0


# -- agreeing on host-side decisions ------------------------------------------------------
def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective: every
    process calls it at the same point of its run)."""
    if jax.process_count() == 1:
        return flag
    with watchdog.waiting():  # a peer that stopped would hang it
        return bool(np.any(multihost_utils.process_allgather(np.array([flag], np.int32))))


def least(value: int) -> int:
    """The least of every process's `value`, an int32 (a collective, as `any_process`)."""
    if jax.process_count() == 1:
        return value
    with watchdog.waiting():
        return int(np.min(multihost_utils.process_allgather(np.array([value], np.int32))))


def from_process_0(flag: bool) -> bool:
    """Process 0's `flag`, on every process (a collective, as `any_process`)."""
    if jax.process_count() == 1:
        return flag
    with watchdog.waiting():
        return bool(multihost_utils.broadcast_one_to_all(np.array(flag, np.int32)))


def refuse_together(check: Callable[[], None], elsewhere: Callable[[int], DpaxError]) -> None:
    """`check()`, which may raise a `DpaxError`, on every process, all of
    them raising when any does: one that raised alone would leave its peers
    waiting in their next collective. A process whose `check` raised raises
    its own error, the others `elsewhere(process)`, the first process that
    found one. A collective with several processes (every process calls it
    at the same point); a single process only runs `check`."""
    if jax.process_count() == 1:
        check()
        return
    try:
        check()
        found = None
    except DpaxError as e:
        found = e
    # One collective says both whether any process found one and which first.
    first = least(jax.process_index() if found is not None else jax.process_count())
    if found is not None:
        raise found
    if first < jax.process_count():
        raise elsewhere(first)
