"""One pytest process with 8 simulated CPU devices covers N = 1, 2, 4, 8 through
device subsets. This must run before anything creates the JAX backend.

Compiled steps go to a persistent XLA cache made for this session: the `dpax`
processes the tests start (README commands, launches, kill -9 and resume)
compile the same steps again and again, and a cache hit replaces a compile
with a file read. Numbers do not change: the cache holds XLA's own executables,
keyed by the program and its options. pytest-xdist's workers inherit the
session's directory from the process that starts them, so they share one
cache; that process removes it at exit. A directory given in
DPAX_TEST_SESSION_DIR is used and left to whoever made it: `make test` gives
its two pytest runs one, so the second reads the first's compiled steps.
"""

import atexit
import functools
import os
import shutil
import tempfile
import time

import jax
import numpy as np
import pytest
from flax import nnx

import dpax
from dpax.data.pipeline import BatchPlan

_SESSION = os.environ.get("DPAX_TEST_SESSION_DIR")
if _SESSION is None:  # the first pytest process: make the session's directory
    _SESSION = os.environ["DPAX_TEST_SESSION_DIR"] = tempfile.mkdtemp(prefix="dpax-test-")
    atexit.register(shutil.rmtree, _SESSION, ignore_errors=True)


def _session_dir(name: str) -> str:
    path = os.path.join(_SESSION, name)
    os.makedirs(path, exist_ok=True)
    return path


_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": _session_dir("xla-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    # The measured MFU peaks (`dpax.parallel.peak`) stay out of the user's ~/.cache.
    "DPAX_CACHE_DIR": _session_dir("dpax-cache"),
    # --tracker wandb: offline, and its staging and caches out of the user's home.
    "WANDB_MODE": "offline",
    **{var: _session_dir(var.lower()) for var in
       ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")},
}
os.environ.update(_CACHE)  # for the subprocesses
jax.config.update("jax_compilation_cache_dir", _CACHE["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

dpax.simulate_devices(8)


@pytest.fixture(autouse=True)
def _no_shared_wandb_service():
    """A W&B run in the test process exports WANDB_SERVICE, and every dpax
    process a later test starts would join that service: a killed run's id
    then stays "in use" there and its resume fails. Each test starts without."""
    before = os.environ.pop("WANDB_SERVICE", None)
    yield
    os.environ.pop("WANDB_SERVICE", None)
    if before is not None:
        os.environ["WANDB_SERVICE"] = before


# Opt-in: where the session's time goes, per test (tests/cost_report.py).
_COSTS = None
if os.environ.get("DPAX_TEST_COST_DIR"):
    from cost_report import CostReport

    _COSTS = CostReport(os.environ["DPAX_TEST_COST_DIR"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _COSTS is None:
        yield
        return
    _COSTS.start(item.nodeid)
    start = time.perf_counter()
    yield
    _COSTS.finish(item.nodeid, time.perf_counter() - start)


def pytest_sessionfinish(session):
    if _COSTS is not None:
        _COSTS.write()


# -- helpers the test files share (imported as `from conftest import ...`) ----------------
STEPS = 10


@functools.cache
def digits():
    return dpax.data.digits()


def max_diff(a, b) -> float:
    """The largest absolute difference of two trees of arrays (lists, dicts), in float64."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                for x, y in zip(la, lb)), default=0.0)


class Towers(nnx.Module):
    """Two embeddings of one input, as a contrastive model has. No bias on the
    second: the loss cannot see it (a softmax over one row is shift-free), so
    its gradient is rounding that Adam would blow up."""

    def __init__(self, rngs):
        self.a = nnx.Linear(8, 16, rngs=rngs)
        self.b = nnx.Linear(8, 16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.a(x), self.b(x)


def check_loss_cli(tmp_path, monkeypatch, module: str, source: str) -> int:
    """`dpax check --model linear --loss MODULE:FN --devices 2 --steps 1`'s
    exit code, `module` ("name:fn") written from `source` into `tmp_path`."""
    from dpax.cli import main

    name = module.split(":")[0]
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return main(["check", "--model", "linear", "--loss", module, "--devices", "2",
                 "--steps", "1"])


def forward(model, *args):
    """`model(*args)` as one compiled program: called op by op, a GPT's forward
    pass compiled some 80 small programs, one per op and shape."""
    from flax import nnx

    return nnx.jit(lambda m, *a: m(*a))(model, *args)


def small_mlp():
    from flax import nnx

    ds = digits()
    return dpax.models.MLP(ds.input_shape, ds.n_out, hidden=16, rngs=nnx.Rngs(0))


def mlp_trainer(n, tx=None, **kw):
    import optax

    return dpax.Trainer(small_mlp(), dpax.classification_loss, tx or optax.sgd(0.1), devices=n,
                        **kw)


def fit_digits(t, batch_size, steps=STEPS, log_every=1):
    ds = digits()
    return t.fit(ds.x_train, ds.y_train, batch_size=batch_size, until_step=steps,
                 log_every=log_every)


def leaves(t):
    return jax.tree.leaves(t.params)


def plain_jit_params(tx, batches):
    import reference

    return reference.plain_jit_params(small_mlp(), tx, batches)


def plan_batches(batch_size, steps=STEPS):
    ds = digits()
    plan = BatchPlan(len(ds.x_train), batch_size, seed=0)
    return [(ds.x_train[plan.indices(s)], ds.y_train[plan.indices(s)]) for s in range(steps)]
