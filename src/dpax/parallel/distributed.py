"""Joining JAX's multi-process runtime (`jax.distributed`), with clear errors.

One process per host, each owning its local devices; collectives span all of
them. JAX aborts the process (a C++ stack trace, no Python exception) when the
coordinator cannot be reached, so dpax checks the address from Python first and
turns a wrong one into a one-line error.
"""

from __future__ import annotations

import dataclasses
import socket
import time

import jax

from dpax import config as cfg
from dpax.errors import DpaxError

# A rank that stops answering is declared dead after this many seconds; the
# others then stop instead of waiting forever in a collective.
DEFAULT_TIMEOUT_S = 30


@dataclasses.dataclass
class DistributedConfig:
    """Joining a multi-process run (`dpax launch` sets these; a cluster JAX
    detects needs none)."""

    coordinator: str | None = cfg.field(
        None, "HOST:PORT of process 0, for multi-process runs (or use dpax launch)", how=True)
    num_processes: int | None = cfg.field(None, "processes in a multi-process run", how=True)
    process_id: int | None = cfg.field(None, "this process's rank, 0..num-processes-1",
                                       how=True)
    timeout: int = cfg.field(
        DEFAULT_TIMEOUT_S, "seconds before an unreachable coordinator or a dead rank stops the "
        "run", how=True)

    def check(self) -> None:
        check_args(self.coordinator, self.num_processes, self.process_id, self.timeout)

    @property
    def processes(self) -> int:
        return self.num_processes or 1


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
                    f"within {timeout:.0f}s; check `coordinator` and that process 0 is running"
                ) from None
            time.sleep(0.5)


def _cluster_detected() -> bool:
    # The environments jax.distributed.initialize() finds by itself (SLURM,
    # Open MPI, cloud TPU, ...). Private, but it is exactly JAX's own list.
    try:
        from jax._src import clusters
    except ImportError:
        return False
    return any(c.is_env_present() for c in clusters.ClusterEnv._cluster_types
               if c.__name__ != "Mpi4pyCluster")  # mpi4py is opt-in in JAX too


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: int = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the multi-process runtime before anything touches the JAX backend.

    With no arguments: join the cluster JAX detects (SLURM, Open MPI, TPU), or
    stay single-process. With all three: join `coordinator` as `process_id` of
    `num_processes`.
    """
    check_args(coordinator, num_processes, process_id, timeout)
    if coordinator is None:
        if _cluster_detected():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(heartbeat_timeout_seconds=timeout)
        return
    host, port = parse_address(coordinator)
    if num_processes == 1:
        return
    _check_reachable(host, port, process_id, timeout)
    # CPU devices of different processes talk over gloo; GPUs and TPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"{host}:{port}", num_processes, process_id,
                               initialization_timeout=timeout,
                               heartbeat_timeout_seconds=timeout)


def is_writer() -> bool:
    """Only process 0 writes run files."""
    return jax.process_index() == 0
