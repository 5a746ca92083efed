"""The XLA:CPU tuning's choices, kept per machine: one file per key under the
dpax cache directory (`dpax.machine.cache_dir`).

A timed choice can change the last bits a step computes (a dot's form,
YNNPACK's kernels for sums), so every process on a machine must take the
same one: a resumed run must compute what the run it resumes computed. The
file is created exclusively: the first process to decide wins, and every
later one reads that choice instead of timing again. A cache that cannot be
read or written is no error; the process then keeps its own timing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

import jax

from dpax.machine import cache_dir, machine_key


@functools.cache
def machine() -> str:
    """This machine's part of every key (read once: every traced step asks)."""
    return machine_key(jax.local_devices(backend="cpu")[0])


def key_of(*parts: Any) -> str:
    """A file name for what `parts` (JSON-serializable) describe."""
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def path(kind: str, key: str) -> str:
    return os.path.join(cache_dir(), kind, f"{key}.json")


def read(kind: str, key: str, field: str) -> Any:
    """The kept choice's `field`, or None if there is none (or it is unreadable)."""
    try:
        with open(path(kind, key)) as f:
            return json.load(f)[field]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_once(kind: str, key: str, field: str, value: Any, about: dict) -> Any:
    """Keep `value` as `field` for `key` unless a process decided first: then
    its choice stands and is returned. `about` is stored beside it (what was
    decided, for a reader of the file)."""
    target = path(kind, key)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({field: value, **about}, f)
        try:
            os.link(tmp, target)  # fails if another process's choice is there
        finally:
            os.unlink(tmp)
    except FileExistsError:
        theirs = read(kind, key, field)
        return value if theirs is None else theirs
    except OSError:
        pass
    return value
