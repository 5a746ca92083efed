"""The README is tested: its Python block runs, its flag table matches the
config, and every command in its bash blocks runs (or says why it cannot)."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from dpax.cli import flags_markdown

pytestmark = pytest.mark.slow  # starts dpax processes or trains long

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
NOT_RUN = "# not run in tests:"


def test_readme_python_block_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README lost its API example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert "'examples': 359" in capsys.readouterr().out


def test_flag_table_is_generated_from_the_config():
    table = README.split("<!-- flags:start -->\n")[1].split("<!-- flags:end -->")[0]
    assert table.strip() == flags_markdown(), "README flag table is stale: run `make docs`"


def bash_lines():
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines += [ln.strip() for ln in block.splitlines() if ln.strip()]
    return lines


def test_every_readme_command_runs(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    digits_x = __import__("dpax").data.digits().x_eval
    np.savez(tmp_path / "x.npz", x=digits_x)  # the input the predict example names
    from test_sources import images

    x, y = images(n=400)
    np.savez(tmp_path / "images.npz", x=x, y=y)  # what the streaming example prepares
    ran = 0
    for line in bash_lines():
        if NOT_RUN in line:
            assert line.split(NOT_RUN)[1].strip(), f"say why it is not run: {line}"
            continue
        if line.startswith("make "):
            target = line.split()[1]
            r = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
            assert r.returncode == 0, f"Makefile lacks {target}: {r.stderr}"
            continue
        assert line.startswith("dpax "), f"README command neither run nor excused: {line}"
        if "|| echo" in line:  # a command shown failing on purpose: it must fail
            r = subprocess.run(line.split("||")[0], shell=True, cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 1, line
            continue
        r = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{line}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        if line.startswith("dpax check"):  # test_batchnorm_dropout leaves cnn-bn to this one
            assert "\nequivalent (tolerance" in r.stdout, r.stdout
        ran += 1
    assert ran >= 8
    assert (tmp_path / "preds.npz").exists()
    assert (tmp_path / "runs" / "compare-one-vs-eight.png").exists()
    # The bench command is the bench's smoke test: every method has its row.
    table = (tmp_path / "runs" / "bench" / "results.md").read_text()
    for method in ("pmap loop", "jit 1 device", "jit sharded", "dpax/shard_map", "dpax/pmap",
                   "dpax/k=8"):
        assert f"| tiny | 8 | {method} |" in table, table
    assert "every method trains with adam" in table.splitlines()[0]
    assert (tmp_path / "runs" / "bench" / "steps_per_sec_vs_devices.png").stat().st_size > 10_000


@pytest.mark.parametrize("command", ["train", "launch", "eval", "predict", "plot", "check",
                                     "bench", "devices", "sample", "prepare"])
def test_every_subcommand_is_documented(command):
    assert f"dpax {command}" in README
