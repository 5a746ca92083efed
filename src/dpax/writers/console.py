"""Progress on the console: a tqdm bar on a terminal, plain lines otherwise.

Both update only at log steps, from rows already on the host: progress never
adds a device sync.
"""

from __future__ import annotations

import shutil
import sys
from typing import IO

from dpax.writers import MetricWriter

FALLBACK_COLUMNS = 100  # bar width where the terminal reports none
SHOWN = ("loss", "bpb", "accuracy", "eval_loss", "eval_bpb", "eval_accuracy", "lr", "grad_norm",
         "skipped", "tokens_per_sec", "mfu")
LABELS = {"tokens_per_sec": "tok/s"}  # shorter names where the bar is tight


def _fmt(row: dict) -> dict[str, str]:
    shown = {LABELS.get(k, k): f"{row[k]:.4g}" for k in SHOWN
             if isinstance(row.get(k), (int, float))}
    if shown.get("skipped") == "0":
        del shown["skipped"]  # only worth a column when steps were skipped
    return shown


class LineWriter(MetricWriter):
    """One plain line per log step (CI, log files: no carriage returns)."""

    def __init__(self, total_steps: int, stream: IO[str] | None = None):
        self._total, self._stream = total_steps, stream or sys.stdout

    def write(self, step: int, row: dict) -> None:
        parts = [f"step {step}/{self._total}"]
        parts += [f"{k} {v}" for k, v in _fmt(row).items()]
        if "steps_per_sec" in row:
            parts.append(f"{row['steps_per_sec']:.1f} steps/s")
        print("  ".join(parts), file=self._stream, flush=True)


class ProgressBar(MetricWriter):
    """A live bar: step, epoch, loss, accuracy, steps/s and ETA."""

    def __init__(self, total_steps: int, start: int = 0, stream: IO[str] | None = None):
        from tqdm import tqdm

        # Some containers and CI ptys report a width of 0 columns, which tqdm
        # takes literally (no bar at all): draw a fixed width there.
        width = shutil.get_terminal_size(fallback=(0, 0)).columns
        self._bar = tqdm(total=total_steps, initial=start, file=stream or sys.stdout,
                         unit="step", desc="train", dynamic_ncols=width > 0,
                         ncols=None if width > 0 else FALLBACK_COLUMNS)
        self._shown: dict[str, str] = {}

    def write(self, step: int, row: dict) -> None:
        if "epoch" in row:
            self._bar.set_description(f"epoch {row['epoch']:.1f}", refresh=False)
        self._shown.update(_fmt(row))  # an eval row adds to the last train values
        self._bar.set_postfix(self._shown, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def console_writer(total_steps: int, start: int, stream: IO[str], verbose: bool = False):
    """A bar when `stream` is a terminal (and not verbose), plain lines otherwise."""
    if stream.isatty() and not verbose:
        return ProgressBar(total_steps, start, stream)
    return LineWriter(total_steps, stream)
