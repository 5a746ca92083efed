"""Which devices a run uses, and the mesh axes they form: simulated CPU
devices, subsets, clear limits, and what the devices can compute.

One mesh axis, `AXIS`, holds every device; with hybrid sharding
(`replicas` > 1) the devices form a 2-D mesh: `REPLICAS` groups along the
first axis, each group's devices along `AXIS`. A split state is split
along `AXIS` only (inside a group) and replicated along `REPLICAS`, and
what spans every device (a batch's rows, a sum over the global batch) runs
over both (`device_axes`)."""

from __future__ import annotations

import jax

from dpax.errors import DpaxError

AXIS = "data"  # the devices of a group (every device without hybrid sharding)
REPLICAS = "replicas"  # hybrid sharding: the groups, across which the state is replicated

# XLA:CPU builds one thread pool and one stream per simulated device; past a few
# hundred the process spends its time in thread start-up, so dpax refuses more.
MAX_SIMULATED_DEVICES = 256


def _backend_started() -> bool:
    # jax keeps no public flag for this; the private one is stable since 0.4.
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def simulate_devices(n: int) -> None:
    """Expose at least `n` CPU devices to JAX, for laptops and CI.

    Must run before JAX creates its backend (before the first array or
    `jax.devices()` call). Calling it later is fine if the CPU backend already
    has at least `n` devices. A later, smaller request never shrinks what an
    earlier one set up.

    Args:
      n: number of CPU devices, 1..MAX_SIMULATED_DEVICES.

    Raises:
      DpaxError: `n` is not a whole number in that range, or JAX already
        started with fewer than `n` CPU devices.
    """
    if not isinstance(n, int) or n < 1:
        raise DpaxError(f"simulate_devices needs a device count >= 1, got {n!r}")
    if n > MAX_SIMULATED_DEVICES:
        raise DpaxError(
            f"{n} simulated devices is more than the cap of {MAX_SIMULATED_DEVICES}; "
            "use fewer devices"
        )
    if _backend_started():
        have = len(jax.devices("cpu"))
        if have >= n:
            return
        raise DpaxError(
            f"JAX already started with {have} CPU device(s), so {n} cannot be simulated "
            "now; call dpax.simulate_devices() before any JAX computation"
        )
    # "At least n": a later, smaller request (an example run inside a test
    # process that asked for 8) must not shrink what an earlier one set up.
    jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))


def select_devices(n: int | None = None) -> list[jax.Device]:
    """The first `n` local devices of the default backend (all when `n` is None).

    A subset is fine: a process with 8 devices can train on 1, 2 or 4 of them.
    With several processes the mesh spans every process's devices, and each
    process brings all of its own.

    Args:
      n: how many devices, or None for all.

    Returns:
      The devices: with several processes, every process's (`jax.devices()`).

    Raises:
      DpaxError: `n` is not a whole number >= 1, is more than the local
        devices, or, with several processes, is not all of them.
    """
    available = jax.local_devices()
    if jax.process_count() > 1:
        # Several processes: the mesh spans every process's devices, and each
        # process brings all of its own (a subset would leave holes in the mesh).
        if n not in (None, len(available)):
            raise DpaxError(f"with several processes each uses all its {len(available)} "
                            f"local devices; leave `devices` out or set `devices={len(available)}`")
        return list(jax.devices())
    if n is None:
        return list(available)
    if not isinstance(n, int) or n < 1:
        raise DpaxError(f"`devices` must be a whole number >= 1, got {n!r}")
    if n > len(available):
        kind = available[0].platform
        simulate = (f", or call `dpax.simulate_devices({n})` before JAX starts"
                    if kind == "cpu" else "")
        raise DpaxError(
            f"asked for {n} devices but only {len(available)} {kind} device(s) are "
            f"available; use `devices={len(available)}` or fewer{simulate}"
        )
    return list(available[:n])


def device_axes(replicas: int = 1) -> str | tuple[str, str]:
    """The mesh axis name(s) spanning every device: what a batch's rows are
    split over and what a sum over the global batch runs over."""
    return AXIS if replicas == 1 else (REPLICAS, AXIS)


def replica_count(replicas: int | str, devices: int, processes: int) -> int:
    """The number of replica groups `replicas` asks for on `devices` devices
    (over every process): a whole number that divides them, or "processes",
    one group per process (per host).

    Raises:
      DpaxError: anything else, or a count that does not divide the devices.
    """
    if replicas == "processes":
        replicas = processes
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise DpaxError(f"`replicas` must be a whole number >= 1 or 'processes', "
                        f"got {replicas!r}")
    if devices % replicas:
        raise DpaxError(f"`replicas={replicas}` does not divide the {devices} devices into "
                        "equal groups; use a divisor of the device count")
    return replicas


def describe() -> str:
    """What JAX sees, one device per line (for `dpax devices`)."""
    lines = [
        f"jax {jax.__version__}  backend {jax.default_backend()}  "
        f"process {jax.process_index()}/{jax.process_count()}  "
        f"{jax.local_device_count()} local / {jax.device_count()} global device(s)"
    ]
    lines += [f"  {d.id:>3}  {d.platform:<5} {d.device_kind}" for d in jax.local_devices()]
    return "\n".join(lines)
