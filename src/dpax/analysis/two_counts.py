"""A forward that does not trace with its number of rows as a symbol
(`len(x)`, `float(x.shape[0])`, a Python `if` on it, NumPy on a shape),
judged from two concrete traces: at the rows a device holds and at one
device's (`dpax.analysis.batch_size` asks, where its symbolic trace fails).

A value computed from the number differs between the two traces where the
rest does not: a constant (`1 / 6` against `1 / 12`), a parameter (a
power), a branch taken, a NumPy array made per row whose rows differ
(`np.linspace(1, 2, len(x))`). The length of an axis that grows with the
rows (theirs, or their tokens') is no such sign: JAX writes it, as an
integer, into every index along it (a negative index wraps) and a scan's
length over it; nor is an integer array made per row (`np.arange(len(y))`
picking each row's label). So the number used as an integer value goes
unread where an axis is as long. Traces that are not
the same ops (a Python loop over the rows, unrolled) are compared by their
floating-point constants only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from dpax.analysis.propagate import at_call, trace, where

NOT_JUDGED = object()  # what `compare` returns where it cannot tell


def compare(fn: Callable, args: Sequence[Any], rows: Sequence[bool], axis, size,
            devices: int, positions: Callable[[Any, int], list[str]]) -> str | None | object:
    """`fn` traced at the rows a device holds and at `devices` times as many,
    one device's: where it computes with their number, as "`op` at
    file:line", None where it does not, or `NOT_JUDGED`. Found: a position
    among the rows in both traces (`positions(trace, count)`: the places the
    rows-count domain finds in a symbolic trace), and, equation by equation
    where the two traces are the same ops, a constant or parameter that
    differs (`/ len(x)`, `x.shape[0] ** 0.5`, `np.linspace(1, 2, len(x))`, a
    branch taken apart), but an axis's length as an integer. Where the
    traces are not the same ops (a loop over `range(len(x))`, unrolled), a
    floating-point constant found in one only is found, and anything else
    is `NOT_JUDGED`, as where a trace fails."""
    held = next(a.shape[0] for flag, arg in zip(rows, args) if flag
                for a in jax.tree.leaves(arg) if a.ndim)
    counts = (held, held * devices)
    try:
        traces = [trace(fn, _times_rows(args, rows, c // held), axis, size) for c in counts]
    except Exception:  # noqa: BLE001 - the caller's symbolic trace's error says why
        return NOT_JUDGED
    try:
        return _compared(traces, counts, held, devices, positions)
    except Exception:  # noqa: BLE001 - an op or value this reading does not know: no verdict
        return NOT_JUDGED


def _compared(traces: list, counts: tuple[int, int], held: int, devices: int,
              positions: Callable) -> str | None | object:
    """`compare`'s reading of its two traces."""
    one, other = (positions(closed, count) for closed, count in zip(traces, counts))
    both = [place for place in one if place in other]
    if both:
        return both[0]
    pairs = _alike(_program(traces[0]), _program(traces[1]))
    if pairs is not None:
        sizes = (_sizes(traces[0].jaxpr), _sizes(traces[1].jaxpr))
        apart = [at_call(where(a), outer) for a, b, consts, outer in pairs
                 if _apart(a, b, consts, held, devices, sizes)]
        return apart[0] if apart else None
    floats, other = _float_values(traces[0], held), _float_values(traces[1], counts[1])
    apart = ([eqn for value, eqn in floats.items() if value not in other]
             + [eqn for value, eqn in other.items() if value not in floats])
    return where(apart[0]) if apart else NOT_JUDGED


def _program(closed) -> tuple:
    return closed.jaxpr, closed.consts


def _alike(one: tuple, two: tuple, outer=None) -> list | None:
    """The equations of two programs ((jaxpr, consts) each) paired, with
    their constants ({var: value} of each) and the outermost equation they
    are in (whose line is the user's), where they are the same ops in the
    same order, the programs inside them too; else None."""
    (a, a_consts), (b, b_consts) = one, two
    if len(a.eqns) != len(b.eqns):
        return None
    consts = (dict(zip(a.constvars, a_consts)), dict(zip(b.constvars, b_consts)))
    pairs = []
    for x, y in zip(a.eqns, b.eqns):
        inner = list(_programs(x.params)), list(_programs(y.params))
        if x.primitive != y.primitive or len(x.invars) != len(y.invars) \
                or len(inner[0]) != len(inner[1]):
            return None
        pairs.append((x, y, consts, outer or x))
        for p, q in zip(*inner):
            more = _alike(p, q, outer or x)
            if more is None:
                return None
            pairs += more
    return pairs


def _apart(a, b, consts: tuple, rows: int, devices: int, sizes: tuple[set, set]) -> bool:
    """Do two paired equations (at `rows` and `devices` times as many)
    differ by a constant operand or a scalar parameter, beyond the length
    of an axis that grows with the rows (`sizes`: each trace's axis lengths)?"""
    def same(u, v, size: bool = True) -> bool:
        u, v = np.asarray(u), np.asarray(v)
        if (size and u.ndim == v.ndim == 0 and u.dtype.kind in "iu" and v.dtype.kind in "iu"
                and int(u) and int(u) % rows == 0 and int(v) == devices * int(u)
                and int(u) in sizes[0] and int(v) in sizes[1]):
            # An axis by the rows (theirs, or their tokens': R * T): an
            # index's wrap along it, a loop's length over it.
            return True
        return u.dtype.kind == v.dtype.kind and np.array_equal(u, v, equal_nan=True)

    for u, v in zip(a.invars, b.invars):
        if isinstance(u, Literal) != isinstance(v, Literal):
            return True
        if isinstance(u, Literal):
            if not _key(u.val) and not same(u.val, v.val):
                return True
        elif u in consts[0] and v in consts[1]:
            x, y = consts[0][u], consts[1][v]
            if not _key(x) and not _same_per_row(np.asarray(x), np.asarray(y), rows, devices):
                return True  # a weight per row made with NumPy, by the number
    for key, u in a.params.items():
        v = b.params.get(key)
        # A scan's length is the rows' (`lax.map` over them); a power's is not.
        if isinstance(u, (bool, int, float, np.number)) and not same(u, v, key == "length"):
            return True
    return False


def _sizes(jaxpr) -> set[int]:
    """The lengths of every axis of every value in `jaxpr` and the programs
    inside it."""
    found: set[int] = set()
    for eqn in jaxpr.eqns:
        for v in (*eqn.invars, *eqn.outvars):
            found.update(d for d in getattr(v.aval, "shape", ()) if isinstance(d, int))
        for inner, _ in _programs(eqn.params):
            found |= _sizes(inner)
    return found


def _key(value) -> bool:
    """A typed PRNG key, which NumPy cannot hold."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _same_per_row(x: np.ndarray, y: np.ndarray, rows: int, devices: int) -> bool:
    """Two traces' constant: the same, or, made per row (an axis a multiple
    of `rows` long in the first, `devices` times that in the second), the
    same entries for every row: `np.ones(len(x))` and `np.tile(w, len(x))`
    are, `np.linspace(1, 2, len(x))` is not. An integer one made per row is
    a row's position picking its own entry (`logp[np.arange(len(y)), y]`):
    not read."""
    if x.shape == y.shape:
        return x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
    axes = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
    if (x.ndim != y.ndim or len(axes) != 1 or x.shape[axes[0]] % rows
            or y.shape[axes[0]] != devices * x.shape[axes[0]]):
        return False
    if x.dtype.kind in "iu":
        return True
    per_row = x.shape[axes[0]] // rows  # a row's entries along that axis (its tokens)
    first = []
    for z in (x, y):
        blocks = np.moveaxis(z, axes[0], 0)
        blocks = blocks.reshape((blocks.shape[0] // per_row, per_row) + blocks.shape[1:])
        if not np.array_equal(blocks, np.broadcast_to(blocks[:1], blocks.shape), equal_nan=True):
            return False
        first.append(blocks[0])
    return x.dtype == y.dtype and np.array_equal(*first, equal_nan=True)  # `1 / len(x)` is not


def _float_values(closed, rows: int) -> dict:
    """{value: the first equation that reads it} of the floating-point
    constants of `closed` and of the programs inside it: every scalar, and
    every entry of an array with an axis `rows` long (a weight per row made
    with NumPy)."""
    found: dict = {}

    def read(value, eqn) -> bool:
        if _key(value) or not jnp.issubdtype(np.result_type(value), jnp.floating):
            return False
        if np.ndim(value) and rows not in np.shape(value):
            return False
        for v in np.unique(np.asarray(value, np.float64)):
            found.setdefault(repr(float(v)), eqn)
        return True

    def walk(jaxpr, consts):
        arrays = dict(zip(jaxpr.constvars, consts))
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, Literal):
                    read(v.val, eqn)
                elif v in arrays:
                    read(arrays.pop(v), eqn)
            for inner in _programs(eqn.params):
                walk(*inner)

    walk(closed.jaxpr, closed.consts)
    return found


def _programs(params: dict):
    """(jaxpr, its constants) of each program in an equation's params."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr, item.consts
            elif isinstance(item, Jaxpr):
                yield item, ()


def _times_rows(args: Sequence[Any], rows: Sequence[bool], k: int) -> list:
    """`args` with `k` times the rows in those marked by `rows`, as shapes."""
    def times(a):
        return jax.ShapeDtypeStruct((a.shape[0] * k,) + a.shape[1:] if a.ndim else (), a.dtype)

    return [jax.tree.map(times, arg) if flag else arg for arg, flag in zip(args, rows)]
