"""The README and the docs pages are tested: their Python blocks run, the
flag table matches the config, every command in their bash blocks runs (or
says why it cannot), and the architecture page lists every module."""

import pathlib
import re
import shlex
import subprocess

import numpy as np
import pytest

from dpax.cli import main
from dpax.cli.flags import flags_markdown
from dpax.cli.job import TrainConfig

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
TEXTS = {"README.md": README, **PAGES}
NOT_RUN = "# not run in tests:"


def blocks(kind: str) -> list[tuple[str, str]]:
    """(page, block) of every fenced block of `kind`, each distinct block once."""
    seen, out = set(), []
    for name, text in TEXTS.items():
        for block in re.findall(rf"```{kind}\n(.*?)```", text, re.S):
            if block not in seen:
                seen.add(block)
                out.append((name, block))
    return out


@pytest.mark.slow
def test_python_blocks_run(capsys):
    found = blocks("python")
    assert any(name == "README.md" for name, _ in found), "README lost its API example"
    for name, code in found:
        exec(compile(code, name, "exec"), {})
    assert "'examples': 359" in capsys.readouterr().out


def test_flag_table_is_generated_from_the_config():
    table = PAGES["cli.md"].split("<!-- flags:start -->\n")[1].split("<!-- flags:end -->")[0]
    assert table.strip() == flags_markdown(TrainConfig), "flag table is stale: run `make docs`"


def test_the_readme_is_a_front_door_and_the_architecture_page_lists_every_module():
    assert len(README.splitlines()) <= 200
    package = ROOT / "src" / "dpax"
    listed = PAGES["architecture.md"]
    for path in package.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py", "_submodules.py"):
            continue
        assert f" {path.name} " in listed or f" {path.name}\n" in listed, path


def bash_lines():
    lines = []
    for _, block in blocks("bash"):
        lines += [ln.strip() for ln in block.splitlines() if ln.strip()]
    return list(dict.fromkeys(lines))  # a command shown on two pages runs once


def make_targets() -> str:
    """The Makefile's rules as make reads them, running nothing (`make -n test`
    still ran the docs build, a line that calls $(MAKE))."""
    return subprocess.run(["make", "-pRrq", "-f", "Makefile", ":"], cwd=ROOT,
                          capture_output=True, text=True).stdout


def run_command(line: str, capsys) -> tuple[int, str]:
    """(exit code, stdout) of a `dpax ...` line, run through the CLI's `main` in
    this process: a process per line paid ~3 s of imports each, 16 times
    (test_cli.py runs the installed entry point in fresh processes)."""
    capsys.readouterr()
    code = main(shlex.split(line, comments=True)[1:])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
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
            assert re.search(rf"^{target}:", make_targets(), re.M), f"Makefile lacks {target}"
            continue
        assert line.startswith("dpax "), f"README command neither run nor excused: {line}"
        if "|| echo" in line:  # a command shown failing on purpose: it must fail
            assert run_command(line.split("||")[0], capsys)[0] == 1, line
            continue
        code, out = run_command(line, capsys)
        assert code == 0, f"{line}\n{out[-2000:]}"
        if line.startswith("dpax check"):  # test_batchnorm_dropout leaves cnn-bn to this one
            assert "\nequivalent (tolerance" in out, out
        ran += 1
    assert ran >= 8
    assert (tmp_path / "preds.npz").exists()
    assert (tmp_path / "runs" / "compare-one-vs-eight.png").exists()
    # The bench command is the bench's smoke test: every method has its row.
    table = (tmp_path / "runs" / "bench" / "results.md").read_text()
    for method in ("pmap loop", "jit 1 device", "jit sharded", "jit masked", "dpax/shard_map",
                   "dpax/pmap", "dpax/tuned", "dpax/guard", "dpax/k=8"):
        assert f"| tiny | 8 | {method} |" in table, table
    assert "every method trains with adam" in table.splitlines()[0]
    # Each ratio to the best hand loop with its interval, the hand loop's own 1.00x.
    ratios = re.findall(r"^\| tiny \| 8 \| ([^|]+) \|(?:[^|]*\|){4} (\d+\.\d\d)x "
                        r"\[(\d+\.\d\d), (\d+\.\d\d)\] \|", table, re.M)
    assert len(ratios) == 9 and all(float(lo) <= float(r) <= float(hi)
                                    for _, r, lo, hi in ratios), table
    assert {(m, "1.00", "1.00", "1.00") for m in ("pmap loop", "jit sharded")} & set(ratios)
    assert (tmp_path / "runs" / "bench" / "steps_per_sec_vs_devices.png").stat().st_size > 10_000


@pytest.mark.parametrize("command", ["train", "launch", "eval", "predict", "plot", "check",
                                     "bench", "devices", "sample", "prepare", "export"])
def test_every_subcommand_is_documented(command):
    assert f"dpax {command}" in README and f"dpax {command}" in PAGES["cli.md"]
