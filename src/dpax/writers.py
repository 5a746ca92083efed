"""Where log rows go. Each writer is a peer behind one small interface."""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Protocol


class MetricWriter(Protocol):
    def write(self, step: int, row: dict) -> None: ...
    def close(self) -> None: ...


class JsonlWriter:
    """`metrics.jsonl`: one JSON object per log step, flushed as it is written."""

    def __init__(self, path: str, append: bool = False):
        self._f = open(path, "a" if append else "w")

    def write(self, step: int, row: dict) -> None:
        row = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()}
        self._f.write(json.dumps({"step": step, **row}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class ConsoleWriter:
    """One plain line per log step."""

    def __init__(self, total_steps: int, stream: IO[str] | None = None):
        self._total, self._stream = total_steps, stream or sys.stdout

    def write(self, step: int, row: dict) -> None:
        parts = [f"step {step}/{self._total}"]
        for key in ("loss", "accuracy", "eval_loss", "eval_accuracy", "lr", "grad_norm",
                    "skipped"):
            if key in row:
                parts.append(f"{key} {row[key]:.4g}")
        if "steps_per_sec" in row:
            parts.append(f"{row['steps_per_sec']:.1f} steps/s")
        print("  ".join(parts), file=self._stream, flush=True)

    def close(self) -> None:
        pass


class MultiWriter:
    """Fans one row out to several writers."""

    def __init__(self, writers: list[MetricWriter]):
        self._writers = writers

    def write(self, step: int, row: dict) -> None:
        for w in self._writers:
            w.write(step, row)

    def close(self) -> None:
        for w in self._writers:
            w.close()


def save_params(path: str, params: dict[str, object]) -> None:
    """Write `params.npz` atomically: a crash leaves the old file or the new one."""
    import numpy as np

    tmp = path + ".tmp.npz"
    np.savez(tmp, **params)
    os.replace(tmp, path)
