"""Every program in examples/ runs and says what its seed promises."""

import pathlib
import re
import runpy

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def run(name, capsys):
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def test_examples_are_all_tested():
    tested = {"seed000_linear_regression.py", "seed001_002_spmd_basics.py",
              "seed004_nnx_cnn.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_seed000_regression(capsys):
    out = run("seed000_linear_regression.py", capsys)
    assert "replicas in sync: True" in out


def test_seed001_002_spmd(capsys):
    out = run("seed001_002_spmd_basics.py", capsys)
    assert out.count("[240. 240. 240. 240.]  expected 240.0") == 2
    assert "unsharded: (128, 5)" in out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_seed004_cnn(capsys):
    out = run("seed004_nnx_cnn.py", capsys)
    acc = float(re.search(r"eval accuracy ([\d.]+) on 359 examples", out).group(1))
    assert acc >= 0.95
