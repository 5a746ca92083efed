"""The peak FLOP/s a run's MFU divides by, and where it comes from.

A peak that moves with the machine's load makes MFU meaningless (a matmul
timed once on a busy host is too slow, and the run's MFU then exceeds 1), so:

- GPUs and TPUs dpax knows: the device's specification, dense, for the
  precision the step's matmuls run at (`precision=bf16`: bf16; fp32: what
  XLA runs f32 matmuls at by default: TF32 on NVIDIA GPUs, bf16 passes on
  TPUs), times the devices.
- Elsewhere (CPUs, other accelerators): measured, the best of several timed
  f32 matmuls on one device, and kept per machine in a small cache file: a
  later run measures again and keeps the higher figure, so the peak only
  ever moves up towards the hardware's, whatever the load of one run. A
  training step measured faster than the kept peak raises it too (`observe`):
  the hardware evidently does that much. Simulated CPU devices share one
  host's cores: the peak counts once per process.

Either way MFU <= 1: a specification bounds what the device can do, and a
measured peak is raised to any rate the run shows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from dpax.machine import cache_dir, machine_key

# Dense FLOP/s per device from the vendors' data sheets: (bf16, default f32).
# Matched against `device.device_kind` in order, first hit wins.
SPECS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("L4", 121e12, 60e12),
    ("TPU v4", 275e12, 275e12),
    ("TPU v5 lite", 197e12, 197e12),  # v5e
    ("TPU v5", 459e12, 459e12),  # v5p
    ("TPU v6 lite", 918e12, 918e12),  # v6e (Trillium)
)
CACHE_FILE = "peak.json"


@dataclasses.dataclass
class Peak:
    """FLOP/s of all of a run's devices, and how that figure was found."""

    flops: float
    source: str
    measured: bool  # True: a measurement, raised by what a run shows (`observe`)
    key: str | None = None  # the machine's entry in the cache file

    def observe(self, rate: float) -> None:
        """A rate the run reached: a measured peak below it is raised to it."""
        if self.measured and rate > self.flops:
            self.flops = rate
            if "raised" not in self.source:
                self.source += "; raised to a training step's rate"
            _keep(self.key, rate)

    def describe(self) -> str:
        return f"{self.flops / 1e12:.3g} TFLOP/s ({self.source})"


def spec(device_kind: str, precision: str) -> float | None:
    """One device's dense peak for `precision` ("fp32" or "bf16"), if known."""
    for name, bf16, f32 in SPECS:
        if name.lower() in device_kind.lower():
            return bf16 if precision == "bf16" else f32
    return None


def for_devices(devices, precision: str = "fp32") -> Peak:
    """The peak of the hardware under `devices` (every process's)."""
    kind = getattr(devices[0], "device_kind", "")
    one = spec(kind, precision)
    if one is not None:
        return Peak(one * len(devices), f"{kind} data sheet, {precision} dense, "
                    f"{one / 1e12:.0f} TFLOP/s x {len(devices)}", measured=False)
    key = machine_key(devices[0])
    best = max(matmul_peak(), _kept(key))
    _keep(key, best)
    # Simulated CPU devices share their host's cores: once per process.
    count = jax.process_count() if devices[0].platform == "cpu" else len(devices)
    where = "this host" if devices[0].platform == "cpu" else kind
    return Peak(best * count, f"best f32 matmul measured on {where}, kept in "
                f"{cache_path()}" + (f", x {count}" if count > 1 else ""),
                measured=True, key=key)


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """This machine's f32 matmul FLOP/s on one device, the best of `repeats`."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    return best


def cache_path() -> str:
    return os.path.join(cache_dir(), CACHE_FILE)


def _read() -> dict:
    try:
        with open(cache_path()) as f:
            kept = json.load(f)
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        return {}


def _kept(key: str | None) -> float:
    value = _read().get(key, 0.0) if key else 0.0
    return float(value) if isinstance(value, (int, float)) else 0.0


def _keep(key: str | None, flops: float) -> None:
    """Keep `flops` for `key` if higher than what is kept; a cache that cannot
    be written is no error (the run's own measurement still counts)."""
    if key is None or flops <= _kept(key):
        return
    kept = {**_read(), key: flops}
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(kept, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
