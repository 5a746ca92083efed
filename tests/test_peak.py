"""The peak FLOP/s behind MFU: a data sheet's where the device is known,
else the best measurement kept per machine, which only moves up; MFU stays
<= 1 however loaded the machine was when it measured."""

import json
import math
from types import SimpleNamespace

import jax
import pytest

from dpax import machine
from dpax.parallel import peak
from dpax.training.hooks import LanguageModel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path))
    return tmp_path / peak.CACHE_FILE


def test_a_known_accelerator_uses_its_data_sheet_for_every_device():
    h100 = [SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")] * 8
    p = peak.for_devices(h100, "bf16")
    assert p.flops == 8 * 989e12 and not p.measured and "data sheet" in p.source
    assert peak.for_devices(h100, "fp32").flops == 8 * 494e12  # TF32, XLA's f32 default
    assert peak.spec("TPU v5 lite", "bf16") == 197e12
    assert peak.spec("NVIDIA H100 PCIe", "bf16") == 756e12  # not the SXM part's
    p.observe(1e18)  # a data sheet bounds the device: a faster "rate" moves nothing
    assert p.flops == 8 * 989e12


def test_a_measured_peak_is_kept_per_machine_and_only_moves_up(cache, monkeypatch):
    cpus = [SimpleNamespace(platform="cpu", device_kind="cpu")] * 8
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(peak, "matmul_peak", lambda: 100e9)
    first = peak.for_devices(cpus)
    assert first.flops == 100e9 and first.measured and str(cache) in first.source
    monkeypatch.setattr(peak, "matmul_peak", lambda: 40e9)  # measured on a busy machine
    assert peak.for_devices(cpus).flops == 100e9  # the kept, higher figure
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert peak.for_devices(cpus).flops == 200e9  # simulated devices: once per process
    assert list(json.loads(cache.read_text()).values()) == [100e9]


def test_mfu_never_exceeds_one(cache, monkeypatch):
    """A run faster than its measured peak raises the peak (and the kept one)."""
    cpus = [SimpleNamespace(platform="cpu", device_kind="cpu")]
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(peak, "matmul_peak", lambda: 10e9)
    p = peak.for_devices(cpus)
    hook = LanguageModel(flops_per_token=1e6, peak=p)
    rows = [{"weight_per_sec": 5e3, "loss": 1.0}, {"weight_per_sec": 20e3, "loss": 1.0},
            {"weight_per_sec": 5e3, "loss": 1.0}]
    for row in rows:
        hook.on_log(1, row)
    assert [r["mfu"] for r in rows] == [0.5, 1.0, 0.25]
    assert math.isclose(p.flops, 20e9) and "raised" in p.source
    assert peak.for_devices(cpus).flops == 20e9


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(machine.CACHE_ENV, str(blocker / "sub"))  # a directory under a file
    monkeypatch.setattr(peak, "matmul_peak", lambda: 7e9)
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert peak.for_devices([SimpleNamespace(platform="cpu", device_kind="cpu")]).flops == 7e9
