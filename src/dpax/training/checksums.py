"""A checkpoint step's checksums: one small manifest of its files' sizes and
CRC-32s, written inside the step directory before Orbax commits it, checked
before any of its files is read.

CRC-32 catches accidental damage (flipped bits, a truncated or missing file),
not tampering. A step's files are listed in one sorted order that every
process derives from the manifest, so that a check split over processes
names the same first damaged file on all of them (`Damage.rank`).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

MANIFEST = "dpax_checksums.json"
_FORMAT = 1
# Orbax rewrites its step metadata when it commits the step (the commit
# time), and writes its commit marker after the manifest: neither is listed.
_UNLISTED = frozenset({MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt"})
_THREADS = min(4, os.cpu_count() or 1)
_BLOCK = 1 << 24  # bytes per read where a file cannot be mapped

# A damaged file's rank is 2 + 3 * its index + one of these.
_MISSING, _SIZE, _CRC = range(3)
_NO_MANIFEST, _BAD_MANIFEST = 0, 1
INTACT = 2**31 - 1  # the rank of no damage: above every other, in an int32


@dataclasses.dataclass(frozen=True)
class Damage:
    """What is wrong with a step directory: `rank` orders damages so that
    processes agree on one (the least), `text` says it for a message."""

    rank: int
    text: str


def write(step_dir: str) -> None:
    """Write the manifest of every file under `step_dir` (but `_UNLISTED`)."""
    listed = _listed(step_dir)
    crcs = crc32s([os.path.join(step_dir, rel) for rel in listed])
    files = {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)), "crc32": crc}
             for rel, crc in zip(listed, crcs)}
    text = json.dumps({"format": _FORMAT, "algorithm": "crc32", "files": files}, indent=1)
    with open(os.path.join(step_dir, MANIFEST), "w") as f:
        f.write(text)


def check(step_dir: str, process: int = 0, processes: int = 1) -> Damage | None:
    """The first damage found in `step_dir`, or None when it is intact.

    Every process checks that each listed file exists with its size; the
    CRC-32s are split: process `process` of `processes` reads its share.
    """
    files = read_manifest(step_dir)
    if isinstance(files, Damage):
        return files
    names = sorted(files)
    for i, rel in enumerate(names):
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return describe(_rank(i, _MISSING), names)
        if os.path.getsize(path) != files[rel]["bytes"]:
            return describe(_rank(i, _SIZE), names)
    mine = share(names, files, process, processes)
    crcs = crc32s([os.path.join(step_dir, names[i]) for i in mine])
    for i, crc in zip(mine, crcs):  # in the manifest's order: the first damage first
        if crc != files[names[i]]["crc32"]:
            return describe(_rank(i, _CRC), names)
    return None


def read_manifest(step_dir: str) -> dict[str, dict] | Damage:
    """The manifest's {relative path: {"bytes", "crc32"}}, or why there is none."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return describe(_NO_MANIFEST, [])
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        # A step always has files: a manifest that lists none vouches for nothing.
        if manifest.get("format") != _FORMAT or not files or not all(
                isinstance(v["bytes"], int) and isinstance(v["crc32"], str)
                for v in files.values()):
            raise ValueError(manifest.get("format"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return describe(_BAD_MANIFEST, [])
    return files


def damage(step_dir: str, rank: int) -> Damage:
    """The damage of `rank` in `step_dir` (found by another process)."""
    files = read_manifest(step_dir)
    return files if isinstance(files, Damage) else describe(rank, sorted(files))


def describe(rank: int, names: list[str]) -> Damage:
    """The damage of `rank` (of a step whose manifest lists `names`)."""
    if rank == _NO_MANIFEST:
        return Damage(rank, f"it has no {MANIFEST}: an older dpax saved it, or the file "
                            "was removed")
    if rank == _BAD_MANIFEST:
        return Damage(rank, f"its {MANIFEST} is damaged")
    index, kind = divmod(rank - 2, 3)
    what = {_MISSING: "is missing", _SIZE: "changed size since it was saved",
            _CRC: "does not match its checksum"}[kind]
    return Damage(rank, f"{names[index]} {what}")


def share(names: list[str], files: dict[str, dict], process: int,
          processes: int) -> list[int]:
    """The indices (into `names`) of the files process `process` reads: the
    files dealt largest first, each to the process with the fewest bytes so
    far, so that one large file does not leave the others idle."""
    load = [0] * processes
    mine = []
    for i in sorted(range(len(names)), key=lambda i: (-files[names[i]]["bytes"], i)):
        p = load.index(min(load))
        load[p] += files[names[i]]["bytes"]
        if p == process:
            mine.append(i)
    return sorted(mine)


def crc32s(paths: list[str]) -> list[str]:
    """The CRC-32 of each file, as 8 hex digits, computed on a few threads
    (zlib releases the GIL while it sums a buffer)."""
    with ThreadPoolExecutor(min(_THREADS, max(1, len(paths)))) as pool:
        return [f"{crc:08x}" for crc in pool.map(crc32, paths)]


def crc32(path: str) -> int:
    """The CRC-32 of a file, summed over its pages mapped in place (no copy
    through a read buffer), or read in blocks where the file system cannot
    map files (some FUSE mounts)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0  # an empty file cannot be mapped
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return zlib.crc32(mapped)
        except (OSError, ValueError):
            crc = 0
            while block := f.read(_BLOCK):
                crc = zlib.crc32(block, crc)
            return crc


def _rank(index: int, kind: int) -> int:
    return 2 + 3 * index + kind


def _listed(step_dir: str) -> list[str]:
    """The paths under `step_dir`, relative to it, that the manifest lists."""
    found = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel not in _UNLISTED:
                found.append(rel)
    return sorted(found)
