"""Values a jaxpr computes from constants alone, and which of their entries
come from random draws: the index arrays a gather picks the rows by.

`dpax.analysis.rows` reads a gather along the rows by its indices: every
row back at its place (`x[jnp.arange(n)]`, `logp[jnp.arange(n), y]`'s
first part) keeps the rows apart, another known choice of them puts rows
where others were, and rows drawn at random (mixup's permutation) mix.

A value is `Known` when an operand of what computes it is: its entries are
evaluated with NumPy only where a gather asks (most are attention masks no
gather reads), from integers and booleans only, so no rounding of XLA's
can differ from NumPy's. Where an entry cannot be evaluated (an operand
that depends on no row but is not known here, an op not evaluated here),
it is not known, and it is drawn where a random draw reached it. A value
with no known operand is `DRAWN` or, as before, `CONST`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# A value with larger arrays on its way is not evaluated: an index array
# has one entry per row or per token, and a walk must not copy activations.
MOST = 1 << 20
# Depends on no row, and comes from a random draw (a permutation of the rows).
DRAWN = "drawn"
_DRAWS = {"random_bits", "threefry2x32"}


class Known:
    """A value that depends on no row, some of whose entries are known;
    `drawn`: a draw may reach some of them."""

    def __init__(self, make: Callable[[], tuple | None], drawn: bool = False):
        self._make, self._done, self._entries = make, False, None
        self.drawn = drawn

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(value, known, drawn): the value, where it is known, and where it
        comes from a draw; None where it cannot be evaluated."""
        if not self._done:
            self._done = True
            try:
                self._entries = self._make()
            except Exception:  # too large, a division by zero, a shape not read
                self._entries = None
            self._make = None  # the operands' entries are not kept alive
        return self._entries


def constant(value) -> Known | None:
    """`value` (a literal's, a constant's) as a `Known`, where it is an
    array of integers or booleans (checked before it is read)."""
    try:
        dtype = getattr(value, "dtype", None)
        if np.dtype(np.asarray(value).dtype if dtype is None else dtype).kind not in "biu":
            return None
    except TypeError:  # a key, a token: not a number
        return None
    if int(np.size(value)) > MOST:
        return None

    def make():
        array = np.asarray(value)
        return array, np.ones(array.shape, bool), np.zeros(array.shape, bool)

    return Known(make)


def evaluated(eqn, facts: Sequence) -> list | None:
    """`eqn`'s outputs where its operands depend on no row: `Known` where
    one of them is and the primitive is one evaluated here, `DRAWN` where a
    draw reaches it, otherwise None (`CONST`)."""
    name = eqn.primitive.name
    if name in _DRAWS:
        return [DRAWN] * len(eqn.outvars)
    rule = _RULES.get(name)
    if rule is None or len(eqn.outvars) != 1 or (
            facts and not any(isinstance(f, Known) for f in facts)):
        return [DRAWN] * len(eqn.outvars) if _reached(facts) else None
    aval = eqn.outvars[0].aval
    try:
        dtype = np.dtype(aval.dtype)
    except TypeError:
        return None
    if dtype.kind not in "biu":
        return [DRAWN] if _reached(facts) else None
    if int(np.prod(aval.shape)) > MOST:  # known, but too large to read: never evaluated
        return [Known(lambda: None, _reached(facts))]
    shapes = [tuple(getattr(a.aval, "shape", ())) for a in eqn.invars]

    def make():
        operands = [_entries(f, s) for f, s in zip(facts, shapes)]
        if any(o is None for o in operands):
            return None
        values, known, drawn = zip(*operands) if operands else ((), (True,), (False,))
        with np.errstate(all="raise"):  # a division by zero: not evaluated
            value = np.asarray(rule(eqn.params, *values)).astype(dtype)
        if rule in _MOVES:  # entries moved: where they are known moves with them
            known, drawn = rule(eqn.params, *known), rule(eqn.params, *drawn)
        else:  # elementwise (iota: from nothing): known where every operand is
            known = np.logical_and.reduce(np.broadcast_arrays(*known))
            drawn = np.logical_or.reduce(np.broadcast_arrays(*drawn))
        shape = tuple(aval.shape)
        known, drawn = np.broadcast_to(known, shape), np.broadcast_to(drawn, shape)
        return (value, known, drawn & ~known) if value.shape == shape else None

    return [Known(make, _reached(facts))]


def _reached(facts: Sequence) -> bool:
    """May a draw reach any operand (wholly, or some of its entries)?"""
    return any(f == DRAWN or (isinstance(f, Known) and f.drawn) for f in facts)


def _entries(fact, shape: tuple) -> tuple | None:
    """An operand's (value, known, drawn); one that is not `Known` is known
    nowhere (its value a stand-in of ones, which divides by nothing)."""
    if isinstance(fact, Known):
        return fact.entries()
    if int(np.prod(shape)) > MOST:
        return None
    return np.ones(shape, np.int64), np.zeros(shape, bool), np.full(shape, fact == DRAWN)


def _iota(p):
    shape, dim = tuple(p["shape"]), p["dimension"]
    line = np.arange(shape[dim]).reshape([-1 if i == dim else 1 for i in range(len(shape))])
    return np.broadcast_to(line, shape)


def _broadcast_in_dim(p, x):
    shape = [1] * len(p["shape"])
    for i, d in enumerate(p["broadcast_dimensions"]):
        shape[d] = x.shape[i]
    return np.broadcast_to(x.reshape(shape), tuple(p["shape"]))


def _reshape(p, x):
    if p.get("dimensions") is not None:
        raise ValueError("a reshape that transposes")
    return x.reshape(tuple(p["new_sizes"]))


def _slice(p, x):
    strides = p.get("strides") or (1,) * x.ndim
    return x[tuple(slice(a, b, s) for a, b, s in
                   zip(p["start_indices"], p["limit_indices"], strides))]


def _div(p, a, b):  # C's: toward zero, in 64 bits (|INT_MIN| does not fit its type)
    if a.dtype.kind == "u":
        return a // b
    a, b = a.astype(np.int64), b.astype(np.int64)
    return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


def _select_n(p, which, *cases):
    return np.choose(which.astype(np.int64), np.broadcast_arrays(*cases))


def _same(p, x):
    return x


_MOVES: set[Callable] = {
    _broadcast_in_dim, _reshape, _slice, _same,
    squeeze := lambda p, x: np.squeeze(x, tuple(p["dimensions"])),
    transpose := lambda p, x: np.transpose(x, p["permutation"]),
    concatenate := lambda p, *xs: np.concatenate(xs, p["dimension"]),
    stack := lambda p, *xs: np.stack(xs, p["axis"]),
    rev := lambda p, x: np.flip(x, tuple(p["dimensions"])),
}
_RULES: dict[str, Callable] = {
    "iota": _iota, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape,
    "slice": _slice, "squeeze": squeeze, "transpose": transpose, "concatenate": concatenate,
    "stack": stack,
    "rev": rev, "convert_element_type": _same, "copy": _same, "copy_p": _same, "pvary": _same,
    "pcast": _same, "select_n": _select_n, "div": _div,
    "rem": lambda p, a, b: np.fmod(a, b), "clamp": lambda p, lo, x, hi: np.clip(x, lo, hi),
    "add": lambda p, a, b: a + b, "sub": lambda p, a, b: a - b, "mul": lambda p, a, b: a * b,
    "max": lambda p, a, b: np.maximum(a, b), "min": lambda p, a, b: np.minimum(a, b),
    "neg": lambda p, x: -x, "abs": lambda p, x: np.abs(x), "sign": lambda p, x: np.sign(x),
    "and": lambda p, a, b: a & b, "or": lambda p, a, b: a | b, "not": lambda p, x: ~x,
    "xor": lambda p, a, b: a ^ b,
    "eq": lambda p, a, b: a == b, "ne": lambda p, a, b: a != b, "lt": lambda p, a, b: a < b,
    "le": lambda p, a, b: a <= b, "gt": lambda p, a, b: a > b, "ge": lambda p, a, b: a >= b,
}
