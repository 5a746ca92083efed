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
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
# `%name = SHAPE kind(` or `kind-start(` (the async form GPUs use; `-done` only waits).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?\S+ = (.+?) (" + "|".join(KINDS) +
                          r")(-start)?\(", re.M)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # logical, as above


def array_bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO shape, e.g. `(f32[3]{0}, bf16[2,4]{1,0})`."""
    return [DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(shape_text) if dtype in DTYPE_BYTES]


def collectives(hlo_text: str, n: int) -> list[Collective]:
    """Every collective of an optimized HLO module (`compiled.as_text()`) run
    on `n` devices, in program order."""
    found = []
    for shape, kind, start in _INSTRUCTION.findall(hlo_text):
        sizes = array_bytes(shape)
        if start and kind == "all-gather":  # (operand, result): the gathered array
            size = max(sizes)
        elif start:  # all-reduce-start and the others: the buffers themselves
            size = sum(sizes) // (2 if kind == "collective-permute" else 1)
        else:
            size = sum(sizes)
        found.append(Collective(kind, size * (n if kind == "reduce-scatter" else 1)))
    return found


def summary(found: list[Collective]) -> dict[str, dict[str, int]]:
    """kind -> {"count", "bytes"} for the kinds present."""
    out: dict[str, dict[str, int]] = {}
    for c in found:
        entry = out.setdefault(c.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c.bytes
    return out


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for one collective of `nbytes` in a ring."""
    if n == 1:
        return 0.0
    share = (n - 1) / n
    return (2 * share if kind == "all-reduce" else share) * nbytes
