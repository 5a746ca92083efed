"""Does a per-device function mix the examples of its device's rows?

Data parallelism is exact when each example's loss depends on that example
alone (and on what every device holds alike): the global batch's loss is then
the same sum however its rows are split. A loss or a layer that combines the
rows a device holds (a contrastive loss over the batch, a normalization by the
batch's mean that dpax does not synchronize, a sort over the batch) computes
on N devices something one device does not, silently.

`mixing` answers from the function's jaxpr. Every value gets a kind:

- `CONST`: depends on no row (the params, constants, a collective's result);
- `Row(axis, group)`: slice i along `axis` (or the i-th run of `group`
  slices, after a reshape that merges the rows with another axis) depends on
  row i alone; `Row(axis, span=(start, stop, rows))`: the rows
  [start, stop) of the `rows` there are, in order (a slice of them), read
  by the ops that keep rows apart and by `concatenate`;
- `OneRow(i, rows)`: row i's value, the rows' axis dropped (`x[0]`);
- `SUMMARY`: depends on all of the device's rows together (a sum over them);
- `Mixed(where)`: an example's value depends on other examples; `where` names
  the first operation that mixed them;
- `UNKNOWN`: an operation this analysis does not read.

A value that depends on no row and is computed from constants alone (an
index array: `jnp.arange`, a NumPy array) is also known by its value
(`dpax.analysis.known`), so a gather along the rows reads which rows it
picks: each back at its place keeps them apart (`x[jnp.arange(n)]`), any
other choice mixes them (`x[perm]`, mixup), and so do indices that every
device computes alike but whose values are not known here (a random
permutation): only the rows in order keep them apart.

Only what is certain mixes: an elementwise combination of a row's value with
a summary of the rows or, but for a sum, with another row's (`x[1:] * x[:-1]`),
a product of two values' row axes that are not paired,
a cumulative sum, sort or reversal along the rows, rows put back together
in another order (`jnp.roll`), a row picked by a choice over all of
them (`x[jnp.argmax(score)]`, a summary) or one row's value (`x[0]`)
meeting the rows, and rows picked by an index that is not them in order.
What it cannot read it does not judge (`UNKNOWN`), so it never refuses a
model it does not understand. A collective over the devices (`psum`, `all_gather`) makes its
operand `CONST`: it combines every device's rows, as one device would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.extend import core as jcore

from dpax.analysis.indexing import gather, scatter
from dpax.analysis.kinds import (
    CONST,
    SUMMARY,
    UNKNOWN,
    Mixed,
    OneRow,
    Row,
    combine,
    is_elementwise,
    is_one_row,
    is_part,
    moved,
    shape_of,
    span_of,
)
from dpax.analysis.known import DRAWN, Known, constant, evaluated
from dpax.analysis.propagate import Domain, at_call, call_body, propagate, where

# Along an axis (the same shape out, but for top_k's k): on the rows' axis
# they mix them.
_ALONG_AXIS = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev",
               "top_k", "approx_top_k"}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "reduce_xor", "argmax", "argmin", "reduce"}

def mixing(jaxpr: jcore.Jaxpr, rows: Sequence[bool], consts: Sequence = ()) -> list:
    """The kind of each output of `jaxpr` when the inputs marked in `rows`
    hold one row each along their leading axis (all others `CONST`).
    `consts`: the values of `jaxpr.constvars`, where the caller has them."""
    ins = [Row(0) if r and len(getattr(v.aval, "shape", ())) else CONST
           for v, r in zip(jaxpr.invars, rows)]
    return _unknown_values(propagate(jaxpr, ins, Kinds(), consts=consts))


def _alike(k) -> bool:
    """Does `k` depend on no row (`CONST`, `DRAWN`, a `Known` value)?"""
    return k == CONST or k == DRAWN or isinstance(k, Known)


def _unknown_values(kinds: list) -> list:
    """`Known` and `DRAWN` values as `CONST`: what every rule but the
    gather's reads."""
    return [CONST if _alike(k) else k for k in kinds]


def first_mixed(kinds: Sequence) -> Mixed | None:
    return next((k for k in kinds if isinstance(k, Mixed)), None)


class Kinds(Domain):
    """A kind per value (the module's docstring). An index array built from
    the rows and from constants (`logp[jnp.arange(n), y]`'s: the positions
    beside each row's label) is a `Row`, and also has a twin: the `Known`
    it would be with its rows' entries not known (`twins`, by variable),
    which tells a gather whether each row picks from itself."""

    bottom = CONST
    scan_rounds = 8  # the carry's kinds settle in a step or two

    def __init__(self):
        self.twins: dict = {}
        self.scans: dict = {}  # id of a scan over the rows -> its number (`_round`)

    def literal(self, atom):
        return constant(atom.val) or CONST

    def constant(self, value):
        return constant(value) or CONST

    def first(self, eqn, kinds):
        mixed = first_mixed(kinds)
        if mixed is not None:
            return [mixed] * len(eqn.outvars)
        if all(_alike(k) for k in kinds):  # nothing from a row, whatever the op
            if any(k != CONST for k in kinds) and call_body(eqn) is not None:
                return None  # a call (jnp's own jit) computes known values inside
            return evaluated(eqn, kinds) or [CONST] * len(eqn.outvars)
        body = call_body(eqn)
        if body is not None:  # the twins go in with their values
            for inner, outer in zip(body.invars, eqn.invars):
                if isinstance(outer, jcore.Var) and outer in self.twins:
                    self.twins[inner] = self.twins[outer]
        return None

    def collective(self, eqn, kinds, over_axis):
        # (The analysis is not told the devices' axis: every collective is
        # read as over the devices.)
        if any(isinstance(k, OneRow) or is_part(k) for k in kinds):
            # Each device's row i, or its first rows: N devices combine other
            # examples than one device.
            return [Mixed(where(eqn))] * len(eqn.outvars)
        # Every device's rows combined, as one device has them (a sum written
        # pairwise, as dpax's exact sums are, is read so too).
        return [CONST] * len(eqn.outvars)

    def per_device(self, eqn, kinds):
        if eqn.primitive.name in ("ppermute", "all_to_all") and any(
                isinstance(k, (Row, OneRow)) for k in kinds):
            return [Mixed(where(eqn))] * len(eqn.outvars)  # other devices' rows in place
        return self.primitive(eqn, kinds)

    def call(self, eqn, outs):
        body = call_body(eqn)
        for inner, outer in zip(body.outvars, eqn.outvars):
            if isinstance(inner, jcore.Var) and inner in self.twins:
                self.twins[outer] = self.twins[inner]
        return _located(outs, eqn)

    def control(self, eqn, kinds):
        kinds = _unknown_values(kinds)
        if UNKNOWN in kinds or (eqn.primitive.name == "cond" and kinds[0] != CONST):
            return [UNKNOWN] * len(eqn.outvars)
        return None

    def join(self, kinds):
        return _join(_unknown_values(kinds))

    def primitive(self, eqn, kinds):
        self._twin(eqn, kinds)
        if eqn.primitive.name in _INDEXED:  # reads its indices' values
            indices = kinds[1]
            if isinstance(indices, Row):
                indices = self.twins.get(eqn.invars[1], indices)
            return _eqn(eqn, _unknown_values(kinds), indices)
        return _eqn(eqn, _unknown_values(kinds))

    def _twin(self, eqn, kinds):
        """The twin of `eqn`'s output, where it computes from rows and from
        a `Known` value or another twin."""
        if len(eqn.outvars) != 1 or not any(isinstance(k, Row) for k in kinds):
            return
        parts = [self.twins.get(v, CONST) if isinstance(k, Row) else k
                 for v, k in zip(eqn.invars, kinds)]
        if any(isinstance(p, Known) for p in parts):
            twin = evaluated(eqn, [p if _alike(p) else CONST for p in parts])
            if twin and isinstance(twin[0], Known):
                self.twins[eqn.outvars[0]] = twin[0]

    # A scan over the rows (`lax.map(f, x)`, a loop whose carry runs from
    # row to row): each round's body sees one row, the scan's round. A carry
    # out made from it reaches the next round as the rows before that
    # round's, its earlier rows, and what holds both is earlier rows too.
    # Stacked, the rounds' rows are the rows again; the rows before each
    # one, in its place, mix them (a cumulative sum); the carry after the
    # last round holds all of them (a summary, as a sum over the rows).
    # Each scan has its own (a scan over one row's features, inside a map
    # over the rows, carries that row alone).
    def sliced(self, k, eqn):  # the body sees one slice along axis 0
        if isinstance(k, Known):
            return CONST
        if isinstance(k, Row):
            if k.axis == 0:
                return _round(self._scan(eqn)) if k == Row(0) else UNKNOWN
            return dataclasses.replace(k, axis=k.axis - 1)
        return k

    def stacked(self, k, eqn):
        if isinstance(k, Known):
            return CONST
        if _scan_of(k) == self._scan(eqn):  # a value written into a place is not read
            return UNKNOWN if k.placed else Mixed(where(eqn)) if _earlier_rows(k) else Row(0)
        return dataclasses.replace(k, axis=k.axis + 1) if isinstance(k, Row) else k

    def around(self, k, eqn):
        if _scan_of(k) == self._scan(eqn):
            return UNKNOWN if k.placed else _earlier(self._scan(eqn))
        return k

    def carried(self, settled, out, eqn):
        return SUMMARY if settled == _earlier(self._scan(eqn)) else settled

    def _scan(self, eqn) -> int:
        return self.scans.setdefault(id(eqn), len(self.scans))

    def opaque(self, eqn):
        return [UNKNOWN] * len(eqn.outvars)


# In scan n over the rows (`Kinds.sliced`): the round's row, and the rows
# before it, which ones unknown, as `OneRow`s of no row count.
def _round(n: int) -> OneRow:
    return OneRow(-2 * n - 1, -1)


def _earlier(n: int) -> OneRow:
    return OneRow(-2 * n - 2, -1)


def _scan_of(k) -> int | None:
    return (-k.index - 1) // 2 if isinstance(k, OneRow) and k.rows == -1 else None


def _earlier_rows(k: OneRow) -> bool:
    return k.index % 2 == 0


def _located(kinds: list, eqn) -> list:
    """A call's mixing, at the caller's line where jnp's own jit hid it."""
    return [Mixed(at_call(k.where, eqn)) if isinstance(k, Mixed) else k for k in kinds]


def _eqn(eqn, kinds: list, indices=None) -> list:
    """An equation the walk does not open, read by its rule (`indices`: a
    gather's, `Known` where their values are)."""
    if UNKNOWN in kinds:
        return [UNKNOWN] * len(eqn.outvars)
    rule = _RULES.get(eqn.primitive.name)
    if any(isinstance(k, OneRow) for k in kinds):
        out = _with_one_row(eqn, kinds, rule)
        if out == "mix":
            out = Mixed(where(eqn))
        return out if isinstance(out, list) else [out] * len(eqn.outvars)
    if any(is_part(k) for k in kinds) and rule is not None and rule not in _READ_PARTS:
        return [UNKNOWN] * len(eqn.outvars)
    if rule in (gather, scatter):
        out = rule(eqn, kinds, indices)
    elif rule is not None:
        out = rule(eqn, kinds)
    else:
        out = _elementwise(eqn, kinds)
    if isinstance(out, Mixed) or out == "mix":
        out = Mixed(where(eqn))
    return out if isinstance(out, list) else [out] * len(eqn.outvars)


def _elementwise(eqn, kinds: list):
    """An op whose operands are its output's shape (or scalars, or size 1
    along an axis), one element from the same element of each: rows stay
    rows, a summary added to a row mixes. Ops that work along an axis are
    read by their own rules."""
    if not is_elementwise(eqn):
        return UNKNOWN
    shape = shape_of(eqn.outvars[0])
    for a, k in zip(eqn.invars, kinds):
        if isinstance(k, Row) and shape_of(a)[k.axis] != shape[k.axis]:
            return UNKNOWN  # one row's value for every row
    if _paired_runs(kinds) and (eqn.primitive.name not in _PAIRWISE or _overlap(kinds)):
        # Row j with row j + k: x[1:] * x[:-1], a product of the halves, and
        # x[1:] - x[:-1] (a sum's halves never overlap).
        return "mix"
    return combine(kinds)


def _with_one_row(eqn, kinds: list, rule):
    """An op on one row's value (`OneRow`). With nothing else from the rows
    it is that row's value. Against the rows, elementwise or in a product,
    it puts row i's value into every row's (`x - x[0]`, `x @ x[0]`), which
    mixes them, but for row i itself, unless it was written into a place
    (`out.at[i].set(f(x[i]))`: a loop that keeps each row in its place),
    which is not read. One-row values put back in order are the rows again
    (`jnp.stack([f(x[i]) for i in ...])`); several rows' values together
    are a summary of the rows where none was placed."""
    ones = {k for k in kinds if isinstance(k, OneRow)}
    rows = [k for k in kinds if isinstance(k, Row)]
    if rule in (_stack, _concatenate) and any(_scan_of(k) is not None for k in ones):
        return UNKNOWN  # runs by position: a round's row has none
    if rule is _stack:
        return _stacked_rows(eqn, kinds)
    if rule is _concatenate:
        axis = eqn.params["dimension"]
        runs = [_as_run(k, a, axis) for a, k in zip(eqn.invars, kinds)]
        if not any(isinstance(k, OneRow) for k in runs):
            return _concatenate(eqn, runs)
        if len(ones) == 1 and rows and SUMMARY not in kinds and not next(iter(ones)).placed \
                and all(r.axis != axis for r in rows):
            return "mix"  # row i's value beside each row's (`concatenate([x, x[0] * ones], 1)`)
    placed = _placed(eqn, kinds, rule)
    scan = _scan_of(next(iter(ones)))
    if not rows and scan is not None and {k.index for k in ones} == {
            _round(scan).index, _earlier(scan).index}:
        # A round's row with the rows before it: the rows so far.
        return dataclasses.replace(_earlier(scan), placed=placed)
    if len({(k.index, k.rows) for k in ones}) > 1:
        return SUMMARY if not (rows or placed) else UNKNOWN
    one = next(iter(ones))
    if not rows:
        return SUMMARY if SUMMARY in kinds else OneRow(one.index, one.rows, placed)
    if SUMMARY in kinds:
        return "mix"  # the rows meet a sum over them
    if placed or not (rule is _dot_general or (rule is None and is_elementwise(eqn))):
        return UNKNOWN  # a write in place, a gather: not read
    if all(is_one_row(k) and k.span[0] == one.index for k in rows):
        # Row i with itself, where its run stays one long.
        out = shape_of(eqn.outvars[0])
        keeps = rule is None and all(out[k.axis] == 1 for k in rows)
        return rows[0] if keeps else UNKNOWN
    return "mix"


# Ops that write a value into places of another: after them, one row's
# value may stand in some places only.
_PLACING = {"scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
            "scatter-sub", "dynamic_update_slice", "pad", "concatenate"}


def _placed(eqn, kinds: list, rule) -> bool:
    """Does `eqn` leave one row's value in some places only: written into
    another value, a select's case (where the choice says), or times a mask
    that varies where the row's value is broadcast (`one_hot(i, n) * v`)?"""
    if any(isinstance(k, OneRow) and k.placed for k in kinds):
        return True
    name = eqn.primitive.name
    if name in _PLACING:
        return True
    if name == "select_n":  # a case lands where a choice alike on every device says
        return any(isinstance(k, OneRow) for k in kinds[1:]) and kinds[0] == CONST
    if rule is _dot_general:  # an outer product with a one-hot (or with ones)
        lhs, rhs = eqn.invars[:2]
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        free = (len(shape_of(lhs)) - len(lc) - len(lb), len(shape_of(rhs)) - len(rc) - len(rb))
        outer = all(shape_of(lhs)[d] == 1 for d in lc)  # nothing summed
        return outer and any(k == CONST and free[i] for i, k in enumerate(kinds[:2]))
    if name in ("mul", "and") and rule is None and is_elementwise(eqn):
        out = shape_of(eqn.outvars[0])
        spread = {d for a, k in zip(eqn.invars, kinds) if isinstance(k, OneRow)
                  for d in range(len(out)) if (shape_of(a) or (1,) * len(out))[d] == 1 < out[d]}
        return any(k == CONST and shape_of(a) and shape_of(a)[d] > 1
                   for a, k in zip(eqn.invars, kinds) for d in spread)
    return False


def _stacked_rows(eqn, kinds: list):
    """`jnp.stack` of one-row values: rows in order (all of them, or a run)
    are the rows again; all of them in another order mix."""
    if not all(isinstance(k, OneRow) for k in kinds) or len({k.rows for k in kinds}) != 1:
        return UNKNOWN
    index, rows, axis = [k.index for k in kinds], kinds[0].rows, eqn.params["axis"]
    if index == list(range(index[0], index[0] + len(index))):
        return Row(axis, span=None if len(index) == rows else
                   (index[0], index[0] + len(index), rows))
    return "mix" if sorted(index) == list(range(rows)) else UNKNOWN


def _as_run(k, atom, axis: int):
    """One row's value, one long along `axis`, as that row's run there."""
    if isinstance(k, OneRow) and shape_of(atom)[axis] == 1:
        return Row(axis, span=(k.index, k.index + 1, k.rows))
    return k


# Additions of disjoint runs paired by position are not read: a sum over the
# rows written pairwise (a synchronized BatchNorm's exact sum) adds its halves
# so. A difference of runs is no part of a sum: it mixes.
_PAIRWISE = {"add", "add_any"}


def _overlap(kinds: list) -> bool:
    """Do these runs share rows? A sum written pairwise adds disjoint halves
    of its rows; runs that overlap pair each row with one some rows on."""
    spans = [k.span for k in kinds if isinstance(k, Row)]
    return max(s[0] for s in spans) < min(s[1] for s in spans)


def _paired_runs(kinds: list) -> bool:
    """Are these runs of the same rows' axis, as long, from other positions?"""
    runs = {k for k in kinds if isinstance(k, Row)}
    return (len(runs) > 1 and all(is_part(k) and k.group == 1 for k in runs)
            and len({k.axis for k in runs}) == 1
            and len({k.span[1] - k.span[0] for k in runs}) == 1)


# -- ops that move, keep or remove axes -------------------------------------------------------
def _broadcast_in_dim(eqn, kinds):
    k = kinds[0]
    if not isinstance(k, Row):
        return combine(kinds)
    dims, shape = eqn.params["broadcast_dimensions"], eqn.params["shape"]
    if shape_of(eqn.invars[0])[k.axis] != shape[dims[k.axis]]:
        return UNKNOWN
    return moved(k, dims[k.axis])


def _transpose(eqn, kinds):
    k = kinds[0]
    return moved(k, list(eqn.params["permutation"]).index(k.axis)) if isinstance(k, Row) \
        else k


def _squeeze(eqn, kinds):
    k = kinds[0]
    if not isinstance(k, Row):
        return k
    dims = [d % len(shape_of(eqn.invars[0])) for d in eqn.params["dimensions"]]
    if k.axis in dims:
        return OneRow(k.span[0], k.span[2]) if is_one_row(k) else UNKNOWN
    return moved(k, k.axis - sum(d < k.axis for d in dims))


def _reshape(eqn, kinds):
    k = kinds[0]
    if not isinstance(k, Row):
        return k
    old, new = shape_of(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    if eqn.params.get("dimensions") is not None:
        return UNKNOWN
    if old[:k.axis + 1] == new[:k.axis + 1]:  # the axes up to the rows' unchanged
        return k
    if is_part(k):
        return UNKNOWN
    if int(np.prod(old[:k.axis])) != 1:  # rows interleaved with an outer axis
        return UNKNOWN
    # Each row is a contiguous run of `per_row` elements, in row-major order.
    per_row = int(np.prod(old[k.axis:])) * k.group // old[k.axis]
    axis = next((i for i, s in enumerate(new) if s != 1), None)
    if axis is None:
        return UNKNOWN
    inner = int(np.prod(new[axis + 1:]))
    if per_row % inner:
        return UNKNOWN  # a slice along the new axis holds parts of several rows
    return Row(axis, per_row // inner)


def _reduce(eqn, kinds):
    k = combine(kinds[:len(eqn.outvars)])  # a variadic reduce: operands, then inits
    if not isinstance(k, Row):
        return k
    axes = eqn.params.get("axes", eqn.params.get("dimensions", ()))
    axes = [a % len(shape_of(eqn.invars[0])) for a in axes]
    if k.axis in axes:
        if is_one_row(k):
            return OneRow(k.span[0], k.span[2])
        return UNKNOWN if is_part(k) else SUMMARY  # a sum over some rows: not read
    return moved(k, k.axis - sum(a < k.axis for a in axes))


def _along_axis(eqn, kinds):
    """cumsum & co., sort, rev, top_k: along their axis; on the rows' axis they mix."""
    p = eqn.params
    axes = p.get("dimensions", (p.get("axis", p.get("dimension", p.get("reduction_dimension"))),))
    rank = len(shape_of(eqn.invars[0]))
    axes = {a % rank for a in axes}
    out = combine(kinds)
    if isinstance(out, Row) and out.axis in axes and not is_one_row(out):
        return "mix"
    return out


def _dot_general(eqn, kinds):
    lhs, rhs = kinds
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = len(shape_of(eqn.invars[0])), len(shape_of(eqn.invars[1]))
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]

    def out_axis(side, k):  # (where the row axis lands, or SUMMARY if contracted)
        contract, batch, free = (lc, lb, lfree) if side == 0 else (rc, rb, rfree)
        if k.axis in contract:
            return SUMMARY
        if k.axis in batch:
            return batch.index(k.axis)
        offset = len(lb) + (0 if side == 0 else len(lfree))
        return offset + free.index(k.axis)

    if isinstance(lhs, Row) and isinstance(rhs, Row):
        if lhs.group != rhs.group:
            return UNKNOWN
        paired = (lhs.axis in lb and rhs.axis in rb and lb.index(lhs.axis) == rb.index(rhs.axis))
        paired_contract = (lhs.axis in lc and rhs.axis in rc
                           and lc.index(lhs.axis) == rc.index(rhs.axis))
        if (paired and lhs.span != rhs.span) or (paired_contract and (
                is_part(lhs) or is_part(rhs))):
            return UNKNOWN  # rows paired with other rows by position, or some rows' sum
        if paired:
            return moved(lhs, lb.index(lhs.axis))
        if paired_contract:
            return SUMMARY  # e.g. x.T @ y over the rows: a sum over them
        if is_one_row(lhs) and lhs.span == rhs.span:  # one row with itself (c @ c.T)
            return moved(lhs, out_axis(0, lhs))
        return "mix"  # e.g. x @ y.T: every row with every other (a contrastive loss)
    if SUMMARY in kinds:
        other = rhs if lhs == SUMMARY else lhs
        return "mix" if isinstance(other, Row) else SUMMARY
    side, k = (0, lhs) if isinstance(lhs, Row) else (1, rhs)
    lands = out_axis(side, k)
    if lands == SUMMARY:
        return UNKNOWN if is_part(k) else SUMMARY
    return moved(k, lands)


def _conv(eqn, kinds):
    lhs, rhs = kinds[0], kinds[1]
    if rhs != CONST or not isinstance(lhs, Row) or eqn.params.get("batch_group_count", 1) != 1:
        return UNKNOWN if lhs != SUMMARY else SUMMARY
    dn = eqn.params["dimension_numbers"]
    if lhs.axis != dn.lhs_spec[0]:
        return UNKNOWN
    return moved(lhs, dn.out_spec[0])


def _keeps_rows(full_on_rows):
    """An op that keeps the rows' axis when `full_on_rows(eqn, axis)`: a
    slice, pad or window that spans it whole (otherwise not read)."""
    def rule(eqn, kinds):
        out = combine(kinds)
        if not isinstance(out, Row):
            return out if out != "mix" else UNKNOWN
        return out if full_on_rows(eqn, out.axis) else UNKNOWN
    return rule


def _slice(eqn, kinds):
    """A slice: of the rows' axis, whole or a run of rows in order (`Row.span`)."""
    k = kinds[0]
    if not isinstance(k, Row):
        return k
    p, shape = eqn.params, shape_of(eqn.invars[0])
    start, stop = p["start_indices"][k.axis], p["limit_indices"][k.axis]
    if (p.get("strides") or (1,) * len(shape))[k.axis] != 1:
        return UNKNOWN
    if (start, stop) == (0, shape[k.axis]):
        return k
    if k.group != 1:
        return UNKNOWN
    first, _, rows = span_of(k, shape[k.axis])
    return dataclasses.replace(k, span=(first + start, first + stop, rows))


def _split(eqn, kinds):
    """`jnp.split`: runs of the rows in order, where it splits along them."""
    k = kinds[0]
    if not isinstance(k, Row) or k.axis != eqn.params["axis"]:
        return [k] * len(eqn.outvars)
    if k.group != 1:
        return [UNKNOWN] * len(eqn.outvars)
    first, _, rows = span_of(k, shape_of(eqn.invars[0])[k.axis])
    out, start = [], first
    for size in eqn.params["sizes"]:
        out.append(dataclasses.replace(k, span=(start, start + int(size), rows)))
        start += int(size)
    return out


def _dynamic_slice_full(eqn, axis):
    return eqn.params["slice_sizes"][axis] == shape_of(eqn.invars[0])[axis]


def _dynamic_slice(eqn, kinds):
    """Where a start comes from every row (`x[jnp.argmax(score)]`): the rows
    picked by it are the batch's choice (a summary), and each row read at a
    place chosen by every row mixes them."""
    operand, *starts = kinds
    if isinstance(operand, Row):  # a run of rows (`_part`) never gets here: `_eqn`
        # The axes read at a place every row chose (a whole axis reads all of it).
        chosen = [i for i, s in enumerate(starts)
                  if s == SUMMARY and not _dynamic_slice_full(eqn, i)]
        if operand.axis in chosen:
            return SUMMARY
        if chosen:
            return "mix"
    return _keeps_rows(_dynamic_slice_full)(eqn, kinds)


def _pad_full(eqn, axis):
    return tuple(eqn.params["padding_config"][axis]) == (0, 0, 0)


def _pad(eqn, kinds):
    """A pad of the rows' axis in front puts each row where the one before
    it was (`jnp.pad(x, ((1, 0), (0, 0)))[:-1]`): that mixes them. Padding
    after them (a pairwise sum's odd row) is not read."""
    k = kinds[0]
    if isinstance(k, Row) and k.group == 1 and eqn.params["padding_config"][k.axis][0] > 0:
        return "mix"
    return _keeps_rows(_pad_full)(eqn, kinds)


def _window_one(eqn, axis):
    p = eqn.params
    return (p["window_dimensions"][axis] == 1 and p["window_strides"][axis] == 1
            and tuple(p["padding"][axis]) == (0, 0)
            and p["base_dilation"][axis] == 1 and p["window_dilation"][axis] == 1)


def _concatenate(eqn, kinds):
    """Along the rows: runs of them back in order are the rows; all of them
    in another order (`jnp.roll`, halves swapped) put rows where others
    were, which mixes them."""
    axis = eqn.params["dimension"]
    if not any(isinstance(k, Row) and k.axis == axis for k in kinds):
        out = combine(kinds)
        return out if out != "mix" else UNKNOWN
    spans, at = [], 0
    for a, k in zip(eqn.invars, kinds):
        size = shape_of(a)[axis]
        if not size:  # an empty piece (`jnp.roll` by 0 writes one) holds no row
            continue
        if k == CONST and at == 0 and len(kinds) > 1:
            # Constants before the rows put each where another was
            # (`jnp.diff(x, axis=0, prepend=0.)`), as a pad in front does.
            return "mix"
        if not isinstance(k, Row) or k.axis != axis or k.group != 1:
            return UNKNOWN
        spans.append((at, span_of(k, size)))
        at += size
    rows = {span[2] for _, span in spans}
    if len(rows) != 1 or at != rows.pop():
        return UNKNOWN
    if all(offset == span[0] for offset, span in spans):
        return Row(axis)  # every row back where it was
    covered = sorted(span[:2] for _, span in spans)
    if covered[0][0] == 0 and all(a[1] == b[0] for a, b in zip(covered, covered[1:])):
        return "mix"  # every row once, some where others were
    return UNKNOWN


def _stack(eqn, kinds):  # a new axis at `axis`
    out = combine(kinds)
    if not isinstance(out, Row):
        return out if out != "mix" else UNKNOWN
    if any(isinstance(k, Row) and k != out for k in kinds):
        return UNKNOWN
    return moved(out, out.axis + (eqn.params["axis"] <= out.axis))


def _dynamic_update_slice(eqn, kinds):
    operand, update, *starts = kinds
    if any(s != CONST for s in starts):
        return UNKNOWN
    if isinstance(operand, Row) or isinstance(update, Row):
        k = operand if isinstance(operand, Row) else update
        if shape_of(eqn.invars[1])[k.axis] != shape_of(eqn.invars[0])[k.axis]:
            return UNKNOWN
    return combine([operand, update])


def _first(eqn, kinds):
    """random_bits (the key's shape, then the draw's), and the casts of a
    value's type over the devices (`pcast`, `pvary`): the operand's kind."""
    return kinds[0]


def _key_scalar_ok(eqn, kinds):
    """random_fold_in / random_split / random_wrap / unwrap: a key array's
    leading axes are its rows' (a trailing one added or removed)."""
    out = combine(kinds)
    if isinstance(out, Row) and out.axis >= len(shape_of(eqn.outvars[0])):
        return UNKNOWN
    return out if out != "mix" else UNKNOWN


def _join(kinds: list):
    mixed = first_mixed(kinds)
    if mixed is not None:
        return mixed
    found = {k for k in kinds if k != CONST}
    if not found:
        return CONST
    return found.pop() if len(found) == 1 else UNKNOWN


def _while(eqn, kinds):
    return [UNKNOWN] * len(eqn.outvars)


_RULES = {
    "broadcast_in_dim": _broadcast_in_dim, "transpose": _transpose, "squeeze": _squeeze,
    "reshape": _reshape, "dot_general": _dot_general, "conv_general_dilated": _conv,
    "slice": _slice, "dynamic_slice": _dynamic_slice,
    "pad": _pad, "concatenate": _concatenate, "stack": _stack, "split": _split,
    "dynamic_update_slice": _dynamic_update_slice, "gather": gather,
    **{n: scatter for n in ("scatter", "scatter-add", "scatter-mul", "scatter-min",
                             "scatter-max", "scatter-sub")},
    "random_bits": _first, "pcast": _first, "pvary": _first, "random_fold_in": _key_scalar_ok,
    "random_split": _key_scalar_ok, "random_wrap": _key_scalar_ok,
    "random_unwrap": _key_scalar_ok, "while": _while,
    **{n: _reduce for n in _REDUCTIONS},
    **{n: _along_axis for n in _ALONG_AXIS},
    **{n: _keeps_rows(_window_one) for n in ("reduce_window_sum", "reduce_window_max",
                                              "reduce_window_min", "reduce_window")},
}
_INDEXED = {"gather", "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
            "scatter-sub"}
# The rules that read a slice of the rows (`Row.span`); any other rule's
# inputs that hold one give `UNKNOWN`.
_READ_PARTS = {_broadcast_in_dim, _transpose, _squeeze, _reshape, _reduce, _along_axis,
               _dot_general, _conv, _slice, _split, _concatenate, _stack, gather, _first,
               _key_scalar_ok}
