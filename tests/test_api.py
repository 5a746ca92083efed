"""The public API: a small set of names a type checker can resolve, the
pmap idioms under `dpax.pmap`, and one base for every exception dpax raises."""

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import jax
import optax
import pytest
from flax import nnx

import dpax
from dpax import errors
from dpax.cli import devices, main
from dpax.cli.exits import EXIT_BAD_STEPS, EXIT_FAILED, EXIT_PREEMPTED, EXIT_USAGE

INIT = pathlib.Path(dpax.__file__)
PMAP_IDIOMS = {"spmd", "shard_batch", "unshard", "replicate", "unreplicate", "replicas_in_sync"}


def imported_names(path: pathlib.Path) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute) of every `from M import A` in a module,
    however nested (the ones under `if TYPE_CHECKING:` included)."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def test_every_public_name_is_bound_by_an_import_statement():
    bound = imported_names(INIT)
    assert len(dpax.__all__) == len(set(dpax.__all__))
    missing = [n for n in dpax.__all__ if n not in bound]
    assert not missing, f"in __all__ but bound by no import statement: {missing}"
    for name in dpax.__all__:  # what a type checker reads is what Python gives
        module, attribute = bound[name]
        source = importlib.import_module(module)
        expected = getattr(source, attribute, None)
        if expected is None:  # `from dpax import pmap`: a submodule
            expected = importlib.import_module(f"{module}.{attribute}")
        assert getattr(dpax, name) is expected, name


def test_the_lazy_names_are_the_typed_ones():
    # The run-time table and the imports a type checker reads name the same things.
    assert set(dpax._EXPORTS) | {"pmap"} == set(dpax.__all__)
    bound = imported_names(INIT)
    assert {n: bound[n][0] for n in dpax._EXPORTS} == dpax._EXPORTS


@pytest.mark.parametrize("name", [
    "spmd", "replicate", "unreplicate", "shard_batch", "unshard", "replicas_in_sync",
    "describe", "BatchPlan", "pad_batch", "Dataset", "MAX_SIMULATED_DEVICES",
    "train", "TrainConfig", "ModelConfig", "DataConfig", "OptimizerConfig",
    "DpaxException", "LogTo"])
def test_internals_and_the_cli_job_are_off_the_top_level(name):
    assert not hasattr(dpax, name)


def test_the_pmap_idioms_live_in_dpax_pmap():
    assert set(dpax.pmap.__all__) == PMAP_IDIOMS
    assert all(callable(getattr(dpax.pmap, n)) for n in PMAP_IDIOMS)


def test_the_cli_job_is_importable_from_dpax_cli_train():
    from dpax.cli import job, train

    assert train.TrainConfig is job.TrainConfig
    assert {"train", "TrainConfig"} <= set(train.__all__)


def test_every_exception_dpax_defines_is_a_dpax_error():
    defined = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__ and issubclass(c, BaseException)
               and not issubclass(c, Warning)]
    assert len(defined) > 5
    assert all(issubclass(c, dpax.DpaxError) for c in defined), defined
    # The three that stop a started run are RuntimeErrors too; bad input is
    # no ValueError, since the base would have to be one.
    assert {c for c in defined if issubclass(c, RuntimeError)} == {
        dpax.RunFailed, dpax.TooManyBadSteps, dpax.Preempted}
    assert not issubclass(dpax.DpaxError, ValueError)


@pytest.mark.parametrize("error, code", [
    (dpax.RunFailed("the disk is full"), EXIT_FAILED),
    (dpax.TooManyBadSteps("10 non-finite steps"), EXIT_BAD_STEPS),
    (dpax.Preempted("SIGTERM"), EXIT_PREEMPTED),
    (dpax.DpaxError("bad `lr`"), EXIT_USAGE),
    (errors.BadArgument("bad `batch_size`", "batch_size"), EXIT_USAGE),
])
def test_each_kind_keeps_its_exit_code_under_one_base(error, code, monkeypatch, capsys):
    def run(args):
        raise error

    monkeypatch.setattr(devices, "run", run)
    assert main(["devices"]) == code
    assert capsys.readouterr().err.count("\n") == 1


def test_importing_dpax_loads_no_jax():
    # The `dpax` command restarts its process before JAX is imported
    # (dpax.__main__), after importing this package; the names load on first use.
    code = ("import sys, dpax; print('jax' in sys.modules); dpax.Trainer; "
            "from jax._src import xla_bridge; print(xla_bridge.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "False"]  # nor does the Trainer's import start a backend


def test_a_moved_name_says_where_it_lives_now():
    """The names the top level gave up point to their new homes, which exist."""
    for name, where in dpax._MOVED.items():
        path = where.split(" ")[0]
        module, _, attr = path.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), where
        with pytest.raises(AttributeError, match=f"it is {re.escape(where)} now"):
            getattr(dpax, name)


@pytest.mark.parametrize("devices,message", [
    ([], "`devices` is an empty list"),
    ("cpu", "`devices` must be a device count, got 'cpu'"),
    (True, "`devices` must be a device count, got True"),
    ([0, 1], "`devices` lists \\[0, 1\\], not JAX devices"),
    ("twice", "`devices` lists a device twice")])
def test_device_mistakes_are_one_line(devices, message):
    if devices == "twice":
        devices = jax.devices()[:1] * 2
    with pytest.raises(dpax.DpaxError, match=f"{message}.*a list of distinct devices"):
        dpax.Trainer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), dpax.regression_loss,
                     optax.sgd(0.1), devices=devices)
