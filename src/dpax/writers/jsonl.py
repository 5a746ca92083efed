"""`metrics.jsonl`: one JSON object per log step."""

from __future__ import annotations

import json
import math
import os

from dpax.writers import MetricWriter


class JsonlWriter(MetricWriter):
    """Flushed as written, so a crash loses no logged step."""

    def __init__(self, path: str, append: bool = False):
        self._f = open(path, "a" if append else "w")

    def write(self, step: int, row: dict) -> None:
        # Strict JSON: a NaN or infinite metric is written as null.
        row = {k: json_safe(v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()}
        self._f.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_rows(path: str) -> list[dict]:
    """The rows of a `metrics.jsonl` ([] when there is none yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def json_safe(value):
    """Strict JSON has no NaN or infinity: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
