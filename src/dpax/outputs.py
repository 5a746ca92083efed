"""Files a run leaves in `--out`, written atomically: a crash leaves the old
file or the new one, never half of one."""

from __future__ import annotations

import os

import numpy as np


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def save_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
