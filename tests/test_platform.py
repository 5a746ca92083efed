"""The XLA:CPU tuning behind one switch (`dpax.parallel.platform`): GPU and TPU
devices never take it (nor import it), CPU devices take it only when asked,
and on it gives the same params as off, up to the last bits its timed
choices may round differently."""

import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

import dpax
from conftest import digits, max_diff
from dpax.errors import DpaxError
from dpax.parallel import platform
from dpax.xla_cpu.backward import for_xla_cpu


def test_accelerators_take_the_generic_path_and_never_import_the_tuning():
    code = """
import sys
from types import SimpleNamespace
from dpax.parallel import platform
from dpax.training import trainer, step, compiled
p = platform.for_devices([SimpleNamespace(platform="gpu")] * 4, xla_cpu_tuning=True)
print(p.xla_cpu_tuning, p.backward, p.pack_collectives, p.unroll_steps, p.max_in_flight,
      p.compile is platform._plain_jit, any(m.startswith("dpax.xla_cpu") for m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "None", "False", "False", "None", "True", "False"]


def test_cpu_devices_take_the_tuning_only_when_asked(monkeypatch):
    cpus = [SimpleNamespace(platform="cpu")] * 4
    monkeypatch.delenv(platform.ENV, raising=False)
    off = platform.for_devices(cpus)  # the default: the generic path
    assert off == platform.Platform("cpu", False, max_in_flight=platform.MAX_IN_FLIGHT)
    on = platform.for_devices(cpus, xla_cpu_tuning=True)
    assert on.xla_cpu_tuning and on.backward is for_xla_cpu and on.pack_collectives
    assert on.unroll_steps and on.max_in_flight == platform.MAX_IN_FLIGHT
    monkeypatch.setenv(platform.ENV, "1")
    assert platform.for_devices(cpus).xla_cpu_tuning
    assert not platform.for_devices(cpus, xla_cpu_tuning=False).xla_cpu_tuning  # the argument wins
    monkeypatch.setenv(platform.ENV, "yes")
    with pytest.raises(DpaxError, match="DPAX_XLA_CPU_TUNING must be 0 or 1"):
        platform.for_devices(cpus)


def _cnn_trainer(n, tuning, **kw):
    ds = digits()
    model = dpax.make_model("cnn", ds.input_shape, ds.n_out, seed=0)
    return dpax.Trainer(model, dpax.classification_loss, optax.adam(1e-3), devices=n,
                        xla_cpu_tuning=tuning, **kw)


@pytest.mark.tuned
@pytest.mark.parametrize("n,kw", [(4, {}), (3, {"sharding": "full"}),
                                  (2, {"steps_per_call": 4})])
def test_tuning_on_trains_the_same_params(n, kw):
    """The switch changes how the step is built, not what it computes: the
    cnn (max pools, whose gradient the tuning rewrites) on and off."""
    ds = digits()
    params = []
    for tuning in (True, False):
        t = _cnn_trainer(n, tuning, **kw)
        t.fit(ds.x_train, ds.y_train, batch_size=37, until_step=8, log_every=8)
        params.append(jax.tree.leaves(t.params))
        text = t.lower_train_step({"x": ds.x_train[:36], "y": ds.y_train[:36],
                                   "mask": np.ones(36, bool)}).as_text()
        # The backward rewrite leaves no select-and-scatter; the generic step keeps JAX's.
        assert ("select_and_scatter" in text) != tuning
    assert max_diff(*params) < 1e-6


def test_the_generic_all_reduce_is_psum_itself():
    """With the tuning off the gradient tree goes to one psum as it is (no
    packing, no barrier), as a hand-written loop does."""
    t = _cnn_trainer(2, False)
    ds = digits()
    text = t.lower_train_step({"x": ds.x_train[:40], "y": ds.y_train[:40],
                               "mask": np.ones(40, bool)}).as_text()
    assert "optimization_barrier" not in text
    tuned = _cnn_trainer(2, True).lower_train_step(
        {"x": ds.x_train[:40], "y": ds.y_train[:40], "mask": np.ones(40, bool)}).as_text()
    assert "optimization_barrier" in tuned  # the packing's


def test_config_yaml_records_the_tuning_the_environment_chose():
    """A run's config.yaml reruns the same steps without the environment."""
    import dataclasses

    from dpax.cli.job import TrainConfig
    from dpax.cli.train import _resolved

    config = TrainConfig.from_flags(steps=3)
    for taken in (True, False):
        job = SimpleNamespace(trainer=SimpleNamespace(
            platform=platform.Platform("cpu", xla_cpu_tuning=taken)))
        assert _resolved(config, job).trainer.xla_cpu_tuning is taken
    given = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer,
                                                                    xla_cpu_tuning=False))
    assert _resolved(given, job) is given
