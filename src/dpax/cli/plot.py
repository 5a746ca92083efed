"""`dpax plot`: PNG plots of one or several runs' metrics.jsonl, overlaid."""

from __future__ import annotations

import argparse
import os

from dpax.cli.outputs import writable_file
from dpax.errors import DpaxError
from dpax.writers.jsonl import read_rows

NAME = "plot"

PANELS = (("loss", ("loss", "eval_loss")), ("accuracy", ("accuracy", "eval_accuracy")),
          ("learning rate", ("lr",)), ("steps / s", ("steps_per_sec",)))
# Language-model runs (a `tokens_per_sec` column): what their users read instead.
LM_PANELS = (("bits per byte", ("bpb", "eval_bpb")), ("eval perplexity", ("eval_perplexity",)),
             ("tokens / s", ("tokens_per_sec",)), ("MFU", ("mfu",)))


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise DpaxError(f"{run_dir} has no metrics.jsonl; pass a directory made by "
                        "dpax train --out")
    rows = read_rows(path)
    if not rows:
        raise DpaxError(f"{path} is empty; the run logged nothing yet")
    return rows


def default_output(run_dirs: list[str]) -> str:
    """Next to the runs: RUN/metrics.png for one, PARENT/compare-A-vs-B.png for several."""
    dirs = [os.path.abspath(d) for d in run_dirs]
    if len(dirs) == 1:
        return os.path.join(dirs[0], "metrics.png")
    names = "-vs-".join(os.path.basename(d) for d in dirs)
    return os.path.join(os.path.commonpath(dirs), f"compare-{names}.png")


def plot_runs(run_dirs: list[str], out: str | None = None) -> str:
    """Plot loss, accuracy, learning rate and steps/s against the step; one
    colour per run, dashed lines for eval. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.abspath(d)): read_metrics(d) for d in run_dirs}
    out = out or default_output(run_dirs)
    formats = tuple(f".{ext}" for ext in plt.gcf().canvas.get_supported_filetypes())
    plt.close()
    writable_file(out, "out", formats)
    lm = any("tokens_per_sec" in r for rows in runs.values() for r in rows)
    panels = PANELS[:2] + LM_PANELS if lm else PANELS
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(11, 3.5 * (len(panels) // 2)),
                             constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, panels):
        for i, (name, rows) in enumerate(runs.items()):
            for key in keys:
                pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=f"C{i}", linestyle="--" if key.startswith("eval")
                            else "-", marker="o" if len(pts) < 3 else None,
                            label=f"{name} {key}" if len(keys) > 1 else name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        if title in ("loss", "eval perplexity") and ax.lines:
            ax.set_yscale("log")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def add_parser(sub) -> None:
    parser = sub.add_parser(NAME, help="PNG plots of runs' metrics, overlaid",
                            description="Plot loss, accuracy, LR and steps/s of one or more "
                                        "runs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories from --out")
    parser.add_argument("--out", default=None, metavar="FILE.png",
                        help="where to write (default: next to the runs)")


def run(args: argparse.Namespace) -> int:
    print(f"wrote {plot_runs(args.run_dirs, args.out)}")
    return 0
