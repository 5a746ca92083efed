"""The kinds the rows analysis (`dpax.analysis.rows`) gives each value of a
per-device function, and the small reads its rules share: which rows a
value holds, along which axis, and what an elementwise op makes of them.
"""

from __future__ import annotations

import dataclasses

CONST, SUMMARY, UNKNOWN = "const", "summary", "unknown"


@dataclasses.dataclass(frozen=True)
class Row:
    axis: int
    group: int = 1  # consecutive indices along `axis` that hold one row
    # (start, stop, rows): these are rows [start, stop) of `rows`, in order
    # (a slice of them); None: every row.
    span: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class OneRow:
    """The value of one row, `index` of the `rows` there are, its axis
    dropped (`x[0]`): every op on it alone gives that row's value."""

    index: int
    rows: int
    # Written into a place of something else (a scatter, a pad, a select's
    # case, a product with a mask): row i's value may be in some places only,
    # as a loop that writes each row's result into its place leaves it.
    placed: bool = False


@dataclasses.dataclass(frozen=True)
class Mixed:
    where: str  # the operation that first mixed rows, and its source line


def shape_of(atom) -> tuple:
    return tuple(getattr(atom.aval, "shape", ()))


def is_part(k) -> bool:
    """Is `k` a slice of the rows (`Row.span`)?"""
    return isinstance(k, Row) and k.span is not None


def is_one_row(k) -> bool:
    """Is `k` a slice of one row (`x[i:i + 1]`)? Along it nothing mixes."""
    return is_part(k) and k.span[1] - k.span[0] == 1


def span_of(k: Row, size: int) -> tuple[int, int, int]:
    """`k`'s rows, of the `size` its axis has where it holds every row."""
    return k.span or (0, size, size)


def moved(k: Row, axis: int) -> Row:
    return dataclasses.replace(k, axis=axis)


def combine(kinds: list):
    """The kind of elementwise f(a, b, ...) from the kinds of a, b, ..."""
    rows = {k for k in kinds if isinstance(k, Row)}
    if len(rows) > 1:
        axes = {r.axis for r in rows}
        return "mix" if len(axes) > 1 else UNKNOWN  # two row axes: pairs of examples
    if rows and SUMMARY in kinds:
        return "mix"  # a row's value with the batch's: e.g. x - mean(x)
    if rows:
        return rows.pop()
    return SUMMARY if SUMMARY in kinds else CONST


def is_elementwise(eqn) -> bool:
    """Are `eqn`'s operands its output's shape (or scalars, or size 1 along
    an axis, broadcast), with no axis it works along?"""
    out_shapes = {shape_of(v) for v in eqn.outvars}
    if len(out_shapes) != 1:
        return False
    (shape,) = out_shapes
    for a in eqn.invars:
        s = shape_of(a)
        if s and (len(s) != len(shape) or any(d not in (1, o) for d, o in zip(s, shape))):
            return False
    return all(eqn.params.get(p) is None for p in ("axis", "axes", "dimension", "dimensions"))
