"""Integer values a jaxpr computes from constants alone, evaluated with NumPy:
the index arrays (`jnp.arange`, a NumPy array, what they compute) that a
gather picks the rows by.

`dpax.analysis.rows` reads a gather along the rows by its indices: every
row back at its place (`x[jnp.arange(n)]`, `logp[jnp.arange(n), y]`'s
first part) keeps the rows apart, any other choice of rows mixes them. The
values are small (an index per row or per token), and only integers and
booleans are evaluated, so no rounding of XLA's can differ from NumPy's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

# Larger values are not evaluated: an index array has one entry per row
# (or per token), and a walk must not copy activations.
MOST = 1 << 16


@dataclasses.dataclass(frozen=True, eq=False)
class Known:
    """A value that depends on no input of the jaxpr, and what it is."""

    value: np.ndarray


def known(value) -> Known | None:
    """`value` (a literal's, a constant's) as a `Known`, where it is a small
    array of integers or booleans."""
    try:
        array = np.asarray(value)
    except Exception:  # a key, a token: not a number
        return None
    if array.dtype.kind not in "biu" or array.size > MOST:
        return None
    return Known(array)


def evaluated(eqn, facts: Sequence) -> list | None:
    """`eqn`'s outputs as `Known`s, where its operands are literals or
    `Known` facts and its primitive one evaluated here; otherwise None."""
    rule = _RULES.get(eqn.primitive.name)
    if rule is None or len(eqn.outvars) != 1:
        return None
    values = _values(eqn, facts)
    if any(v is None for v in values):
        return None
    aval = eqn.outvars[0].aval
    try:
        dtype = np.dtype(aval.dtype)
        if dtype.kind not in "biu" or int(np.prod(aval.shape)) > MOST:
            return None
        with np.errstate(all="raise"):  # a division by zero: not evaluated
            out = np.asarray(rule(eqn.params, *values)).astype(dtype)
    except Exception:
        return None
    return [Known(out)] if out.shape == tuple(aval.shape) else None


def _values(eqn, facts: Sequence) -> list[np.ndarray | None]:
    """Each operand's value: a `Known` fact's, else None."""
    return [fact.value if isinstance(fact, Known) else None for fact in facts]


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


def _div(p, a, b):  # C's: toward zero
    return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


def _select_n(p, which, *cases):
    return np.choose(which.astype(np.int64), np.broadcast_arrays(*cases))


def _same(p, x):
    return x


_RULES: dict[str, Callable] = {
    "iota": _iota, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape,
    "slice": _slice, "squeeze": lambda p, x: np.squeeze(x, tuple(p["dimensions"])),
    "transpose": lambda p, x: np.transpose(x, p["permutation"]),
    "concatenate": lambda p, *xs: np.concatenate(xs, p["dimension"]),
    "rev": lambda p, x: np.flip(x, tuple(p["dimensions"])),
    "convert_element_type": _same, "copy": _same, "copy_p": _same, "pvary": _same,
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
