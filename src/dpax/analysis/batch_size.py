"""Values computed from how many rows a device holds, or from a row's
position among them.

A loss that divides by `x.shape[0]` (a per-token loss over `B * T`, weights
of `1 / B`) reads the batch size as a number. Each device holds 1/N of the
rows, so on N devices that number is N times smaller than on one: the loss,
and with SGD the step, are scaled by N, and padded shards weigh their real
rows more. Likewise `jnp.arange(x.shape[0])` as a value (a weight by
position, every other example) is a row's position in its device's shard,
not in the batch. No row is mixed with another, so `dpax.analysis.rows`
sees nothing; a jaxpr holds the size as a plain constant.

`uses_rows_count` traces the forward once more with the number of rows as a
symbol (`jax.export.symbolic_shape`): shapes stay symbolic, and a shape
becomes a number only through a `dim_as_value` equation, an `iota` exactly
as long as the rows, or a slice that long of an array that holds none
(`table[:B]`, noise drawn in a fixed shape and cut to the batch: row i gets
entry i). A position along `global_rows`' `N * rows` is the global batch's:
not a source. What such a number flows into is followed: as an index along
the rows (`x[-1]`, `logits[jnp.arange(B), y]`) it only picks rows, which
the rows analysis judges, and JAX adds an axis's own size to a negative
index; as an index along another axis (`table[jnp.arange(B)]`, labels
`jnp.arange(B)` over `global_rows`' columns) or into a floating-point
value it changes what is computed. A `while` loop is read by its carry:
how many rounds run (a loop over the rows, one row a round) is not judged.
A forward that cannot be traced with a symbolic size (`len(x)`, a Python
`if` on it, NumPy on a shape) is traced at a device's rows and at one
device's (`dpax.analysis.two_counts`): positions found in both traces, and
constants that differ between them equation by equation, are found.
Where the two traces are not the same ops, or a trace fails, it is not
judged, and the caller is told.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import export
from jax.extend import core as jcore

from dpax.analysis import two_counts
from dpax.analysis.propagate import Domain, at_call, call_body, propagate, scan, trace, where

_SCATTERS = ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
             "scatter-max")


POSITION = "position"  # a source: a row's position among the device's rows


class FromRowsCount(Domain):
    """A fact per value: the sources it is computed from, a frozenset of
    `POSITION` and the symbolic sizes made numbers (`dim_as_value`), by
    their text. `found`: where the first equation that makes a
    floating-point value from any is."""

    bottom = frozenset()

    def __init__(self, count):
        self.count = count  # the symbol (or a trace's number): a device's number of rows
        self.found: str | None = None
        self.places: list[str] = []  # every equation found, in order
        # Index arrays made by a concatenation along their last axis (jnp's
        # `x[i, j]`): each column's fact, for the operand axis it indexes.
        self.columns: dict = {}

    def first(self, eqn, facts: list) -> list | None:
        name = eqn.primitive.name
        # A position along the device's own rows, not along the global batch
        # (`dpax.models.layers.global_rows`: `N * rows` long, in its order).
        if name == "dim_as_value":
            return [frozenset({str(eqn.params["dim"])})]
        if (name == "iota" and eqn.params["shape"][eqn.params["dimension"]] == self.count
                or name in ("slice", "dynamic_slice", "gather") and _by_rows(eqn, self.count)):
            self._found(eqn)  # a slice's values are floats already
            return [frozenset({POSITION})] * len(eqn.outvars)
        if name == "while":
            return self._while(eqn, facts)
        if name == "scan" and eqn.params["length"] == self.count:
            return scan(eqn, _rounds_counted(eqn, facts, self.count), self)
        return None

    def _found(self, eqn) -> None:
        if any(jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.inexact)
               for v in eqn.outvars):
            self.places.append(where(eqn))
            if self.found is None:
                self.found = self.places[-1]

    def _while(self, eqn, facts: list) -> list:
        """The carry, through the body until its facts settle; the condition's
        operands only say how many rounds run."""
        p = eqn.params
        consts = facts[p["cond_nconsts"]:p["cond_nconsts"] + p["body_nconsts"]]
        carry = facts[p["cond_nconsts"] + p["body_nconsts"]:]
        while True:
            out = propagate(p["body_jaxpr"].jaxpr, consts + carry, self)
            joined = [a | b for a, b in zip(carry, out)]
            if joined == carry:
                return carry
            carry = joined

    def join(self, facts: list) -> frozenset:
        return frozenset().union(*facts)

    def control(self, eqn, facts: list) -> None:
        # A branch picked by the number (`lax.switch(x.shape[0] % 3, ...)`):
        # the user's line is the cond's; the walk then opens it.
        if eqn.primitive.name == "cond" and facts[0]:
            self._found(eqn)
        return None

    def primitive(self, eqn, facts: list) -> list:
        name = eqn.primitive.name
        if name == "concatenate" and eqn.params["dimension"] == eqn.outvars[0].aval.ndim - 1:
            self.columns[eqn.outvars[0]] = [
                f for v, f in zip(eqn.invars, facts) for _ in range(_last(v))]
        if name in ("gather", "dynamic_slice", "dynamic_update_slice") or name in _SCATTERS:
            facts = self._read(eqn, facts)
        out = self.join(facts)
        if out:
            self._found(eqn)
        return [out] * len(eqn.outvars)

    def _read(self, eqn, facts: list) -> list:
        """The facts an indexing equation's result takes: its values', and
        its indices' but what indexing does with them. An index along the
        rows (`x[-1]`, `logits[jnp.arange(B), y]`) picks rows, which the
        rows analysis judges; along any axis JAX adds the axis's own size to
        a negative index. Otherwise (`table[jnp.arange(B)]`, labels
        `jnp.arange(B)` over `global_rows`' columns) an index by the rows'
        number or position is a value by it."""
        name, shape = eqn.primitive.name, eqn.invars[0].aval.shape

        def along(axis, fact):
            return frozenset() if shape[axis] == self.count else fact - {str(shape[axis])}

        if name in ("dynamic_slice", "dynamic_update_slice"):
            first = 1 if name == "dynamic_slice" else 2  # operand(, update), then an index per axis
            return facts[:first] + [along(a, f) for a, f in enumerate(facts[first:])]
        numbers = eqn.params["dimension_numbers"]
        axes = (numbers.start_index_map if name == "gather"
                else numbers.scatter_dims_to_operand_dims)
        columns = self.columns.get(eqn.invars[1], [])
        if len(columns) != len(axes):  # not one column per axis: the indices as a whole
            columns = [facts[1]] * len(axes)
        indexed = self.join([along(a, f) for a, f in zip(axes, columns)])
        return [facts[0], indexed] + facts[2:]  # a scatter's updates too

    def call(self, eqn, outs: list) -> list:
        if self.found is not None:
            self.found = at_call(self.found, eqn)
        self.places = [at_call(place, eqn) for place in self.places]
        return outs

    def opaque(self, eqn) -> list:
        return [frozenset({POSITION})] * len(eqn.outvars)


def uses_rows_count(fn: Callable, args: Sequence[Any], rows: Sequence[bool],
                    axis: str | tuple[str, ...], size: int | tuple[int, ...],
                    not_judged: Callable[[BaseException], None] | None = None) -> str | None:
    """Where `fn(*args)` computes a floating-point value from the number of
    rows of the arguments marked in `rows` (their leading axis) or from a
    row's position among them, as "`op` at file:line", or None where it does
    not, or where it cannot be judged (then `not_judged` gets the symbolic
    trace's error)."""
    held = [a.shape[0] for flag, arg in zip(rows, args) if flag
            for a in jax.tree.leaves(arg) if a.ndim]
    if not held:
        return None
    # At most the rows of all devices, one device's: a slice `[:rows]` of a
    # longer array is then `rows` long (JAX would otherwise type it
    # `min(len, rows)`), and a comparison that one device's number would
    # decide otherwise (`if x.shape[0] > 10`) is not decided. At least half
    # a device's: `top_k(l, 3)`, `linspace(0, 1, rows)` and `x[2:] + x[:-2]`
    # compare the number with a constant, which without a lower bound JAX
    # cannot, and the trace would fail.
    devices = math.prod(size) if isinstance(size, tuple) else size
    (count,) = export.symbolic_shape("rows", constraints=(
        f"rows <= {held[0] * devices}", f"rows >= {max(1, held[0] // 2)}"))
    symbolic = [jax.tree.map(lambda a: _with_rows(a, count), arg) if flag else arg
                for arg, flag in zip(args, rows)]
    try:
        jaxpr = trace(fn, symbolic, axis, size).jaxpr
    except Exception as error:  # `len(x)`, `float(x.shape[0])`: the numbers' constants
        found = two_counts.compare(fn, args, rows, axis, size, devices, _positions)
        if found is two_counts.NOT_JUDGED:
            if not_judged is not None:
                not_judged(error)
            return None
        return found
    domain = FromRowsCount(count)
    propagate(jaxpr, [frozenset()] * len(jaxpr.invars), domain)
    return domain.found


def _positions(closed, count: int) -> list[str]:
    """Where a concrete trace with `count` rows a device makes a value from
    a row's position among them (`two_counts`)."""
    domain = FromRowsCount(count)
    propagate(closed.jaxpr, [frozenset()] * len(closed.jaxpr.invars), domain)
    return domain.places


def _rounds_counted(eqn, facts: list, count) -> list:
    """A scan's operands' facts, a position among the rows added to each
    carry that every round makes from itself, without the rows (a counter,
    a key split each round), and that is read (by the rounds, or after
    them): in a scan over the rows, round i is row i's, so such a carry is
    row i's position (`r * (1 + 0.1 * c)` weighs each row by it). A carry
    made from the rows is the rows analysis's to judge; one as long as the
    rows (rows written into their places) is no position."""
    p = eqn.params
    body, n_consts, n_carry = p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]
    deps = _dependencies(body)
    rows = set(range(n_consts + n_carry, len(body.invars)))
    facts = list(facts)
    for i, (var, out) in enumerate(zip(body.invars[n_consts:], body.outvars[:n_carry])):
        at = n_consts + i
        counts = (out is not var and not isinstance(out, jcore.Literal)
                  and at in deps[i] and not deps[i] & rows and not _has_rows(var, count))
        read = (not isinstance(eqn.outvars[i], jcore.DropVar)
                or any(at in d for o, d in enumerate(deps) if o != i))
        if counts and read:
            facts[at] = facts[at] | {POSITION}
    return facts


def _dependencies(jaxpr) -> list[frozenset]:
    """For each output of `jaxpr`, the indices of the inputs it is computed
    from, through calls (jit, remat) equation by equation; any other
    equation's outputs from all its operands."""
    made = {v: frozenset({i}) for i, v in enumerate(jaxpr.invars)}

    def of(atom):
        return frozenset() if isinstance(atom, jcore.Literal) else made.get(atom, frozenset())

    for e in jaxpr.eqns:
        body = call_body(e)
        if body is not None:
            inner = _dependencies(body)
            for v, d in zip(e.outvars, inner):
                made[v] = frozenset().union(*(of(e.invars[j]) for j in d))
        else:
            every = frozenset().union(*(of(a) for a in e.invars))
            made.update((v, every) for v in e.outvars)
    return [of(v) for v in jaxpr.outvars]


def _has_rows(atom, count) -> bool:
    """An axis by the rows: symbolic, or in a concrete trace `count` long."""
    return any(export.is_symbolic_dim(d) or d == count for d in getattr(atom.aval, "shape", ()))


def _last(atom) -> int:
    """The length of an index array's last axis (1 for a scalar)."""
    shape = getattr(atom.aval, "shape", ())
    return shape[-1] if shape and isinstance(shape[-1], int) else 1


def _by_rows(eqn, count) -> bool:
    """A slice of an array that holds no rows, as many as there are rows
    (`table[:x.shape[0]]`, noise drawn in a fixed shape and cut to the
    batch): row i gets the slice's i-th entry, by position. (A gather
    slices by the rows' number only so; a lookup by ids slices a fixed size.)"""
    sliced = (eqn.params["slice_sizes"] if eqn.primitive.name == "gather"
              else eqn.outvars[0].aval.shape)
    return any(d == count for d in sliced) and not _has_rows(eqn.invars[0], count)


def _with_rows(a, count) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((count,) + a.shape[1:] if a.ndim else (), a.dtype)
