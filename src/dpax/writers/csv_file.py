"""`metrics.csv`: the scalar columns of every log row, for spreadsheets."""

from __future__ import annotations

import csv
import os

from dpax.writers import MetricWriter, scalars

COLUMNS = ["step", "epoch", "examples", "loss", "accuracy", "lr", "grad_norm", "skipped",
           "steps_per_sec", "eval_loss", "eval_accuracy", "eval_examples"]


class CsvWriter(MetricWriter):
    """Fixed columns (empty where a row has no value), so rows line up."""

    def __init__(self, path: str, append: bool = False):
        new = not (append and os.path.exists(path))
        self._f = open(path, "w" if new else "a", newline="")
        self._w = csv.DictWriter(self._f, COLUMNS, extrasaction="ignore")
        if new:
            self._w.writeheader()

    def write(self, step: int, row: dict) -> None:
        self._w.writerow({**scalars(row), "step": step})
        self._f.flush()

    def close(self) -> None:
        self._f.close()
