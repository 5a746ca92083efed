"""Files a run leaves in `--out`: checked before any work starts, written
atomically (a crash leaves the old file or the new one, never half of one)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import numpy as np

from dpax.errors import DpaxError

# What `dpax train --out DIR` writes; a directory holding any of them holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.csv", "params.npz", "metrics.png",
             "tensorboard", "profile")


def writable_dir(path: str, what: str) -> bool:
    """Make sure `path` is a directory this process can write, creating it if
    needed; returns whether it was created (so a run that stops before writing
    anything can remove it again)."""
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dpax-probe-"):
            pass
    except OSError as e:
        raise DpaxError(f"cannot write `{what}={path}`: {e.strerror or e}; "
                        "give a writable directory") from None
    return created


def writable_file(path: str, what: str, suffixes: tuple[str, ...]) -> None:
    """Check that a file can be written at `path` before the work that makes it."""
    if not path or not path.endswith(suffixes) or os.path.isdir(path):
        raise DpaxError(f"`{what}={path}` must be a file path ending in "
                        f"{' or '.join(suffixes)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DpaxError(f"`{what}={path}`: directory {parent} does not exist; create it first")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".dpax-probe-"):
            pass
    except OSError as e:
        raise DpaxError(f"cannot write `{what}={path}`: {e.strerror or e}") from None


def holds_run(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                       for f in RUN_FILES)


def clear_run(path: str) -> None:
    """Remove a previous run's files from `path` (`--overwrite`); anything else stays."""
    for name in RUN_FILES:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.remove(target)


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def save_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def json_safe(value):
    """Strict JSON has no NaN or infinity: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
