"""What a compiled step communicates: every collective in XLA's optimized HLO,
counted with its bytes, to hold against the least its state layout needs
(`Layout.least_collectives`, `dpax.parallel.layout`).

Bytes are logical: the whole buffer a collective reduces or gathers (an
all-reduce's operand, an all-gather's result, a reduce-scatter's input). The
least a data-parallel step can move, with G the gradient bytes and P the
param bytes (the padded shapes of a sharded layout):

  replicated  all-reduce G (plus a few scalars: loss, count, metrics)
  optimizer   reduce-scatter G, all-gather P (the updated params)
  full        all-gather P (each param where the model uses it), reduce-scatter G

On the wire, a ring moves 2(N-1)/N of an all-reduce's bytes per device and
(N-1)/N of an all-gather's or reduce-scatter's (`wire_bytes`).

With hybrid sharding's groups (`dpax.parallel.mesh`), a sharded layout adds
an all-reduce across the groups of each device's gradient slice, G/(N/R)
bytes; a collective's replica groups tell whether it crosses the groups.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
# `%name = SHAPE kind(` or `kind-start(` (the async form GPUs use; `-done` only waits).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?\S+ = (.+?) (" + "|".join(KINDS) +
                          r")(-start)?\(", re.M)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


ACROSS = "across groups: "  # the prefix of a kind that crosses hybrid sharding's groups

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\], device_ids=\(\[([0-9,]+)\]"
                   r"(?:T\(([0-9,]+)\))?\)\s*\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # logical, as above
    across: bool = False  # its devices span several of hybrid sharding's groups


def array_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO shape, e.g. `(f32[3]{0}, bf16[2,4]{1,0})`."""
    return [DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(shape_text) if dtype in DTYPE_BYTES]


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of one collective's HLO line, in any of XLA's three
    spellings (explicit lists, an iota, a mesh and its axes); None if absent."""
    m = _EXPLICIT.search(line)
    if m:
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([0-9,]*)\}",
                                                                     m.group(1))]
    m = _IOTA.search(line)
    if m:
        shape, dims, perm = (_ints(g) for g in m.groups())
        return np.arange(math.prod(dims)).reshape(dims).transpose(perm or None) \
            .reshape(shape).tolist()
    m = _MESH.search(line)
    if m:
        axes = re.findall(r"'([^']+)'=([0-9]+)", m.group(1))
        dims, perm = _ints(m.group(2)), _ints(m.group(3))
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm or None) \
            .reshape([int(size) for _, size in axes])
        inside = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(4)]
        rest = [i for i in range(len(axes)) if i not in inside]
        return ids.transpose(rest + inside).reshape(-1, math.prod(
            int(axes[i][1]) for i in inside)).tolist()
    return None


def _ints(text: str | None) -> list[int]:
    return [int(v) for v in text.split(",") if v] if text else []


def collectives(hlo_text: str, n: int, group: int | None = None) -> list[Collective]:
    """Every collective of an optimized HLO module (`compiled.as_text()`) run
    on `n` devices, in program order; with `group` (the devices of one of
    hybrid sharding's groups, consecutive in the mesh), each marked if it
    spans several groups."""
    found = []
    lines = [line for line in hlo_text.splitlines() if _INSTRUCTION.match(line)]
    for line in lines:
        shape, kind, start = _INSTRUCTION.match(line).groups()
        sizes = array_bytes(shape)
        if start and kind == "all-gather":  # (operand, result): the gathered array
            size = max(sizes)
        elif start:  # all-reduce-start and the others: the buffers themselves
            size = sum(sizes) // (2 if kind == "collective-permute" else 1)
        else:
            size = sum(sizes)
        groups = replica_groups(line) if group else None
        if groups == []:  # `replica_groups={}`: every device in one group
            groups = [list(range(n))]
        across = bool(groups) and any(len({d // group for d in g}) > 1 for g in groups)
        members = len(groups[0]) if groups else n  # a reduce-scatter's input: each one's part
        found.append(Collective(kind, size * (members if kind == "reduce-scatter" else 1),
                                across))
    return found


def summary(found: list[Collective]) -> dict[str, dict[str, int]]:
    """kind -> {"count", "bytes"} for the kinds present (`ACROSS` + kind for
    what crosses hybrid sharding's groups)."""
    out: dict[str, dict[str, int]] = {}
    for c in found:
        entry = out.setdefault(ACROSS * c.across + c.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c.bytes
    return out


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for one collective of `nbytes` in a ring."""
    if n == 1:
        return 0.0
    share = (n - 1) / n
    return (2 * share if kind == "all-reduce" else share) * nbytes
