"""A function run as one compiled program where that gives exactly what
running it op by op gives: the training state's start (`dpax.training.state`).

Op by op, each op of a new shape and dtype compiles a program of its own
(an optimizer's zeros, one per param shape, before the first step). In one
program XLA may round otherwise: it fuses arithmetic, folds constants with
exact math and one rounding, and keeps the denormals its op-by-op kernels
flush to zero (`x == 0` then differs too). So a function goes through as
one program only when its trace shows none of that: every output made by
moves (copy, reshape, broadcast, a conversion from a float of at most 32
bits), by ops on integers and keys alone, or by calls of programs made so;
no effects; no weakly typed output (a Python number, which jit would make
an array). Any other function runs as written.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Ops whose outputs hold their inputs' values.
_MOVES = frozenset({"copy", "reshape", "broadcast_in_dim"})
# Calls of one inner program, looked into; any other op that holds programs
# (a branch, a loop) counts as rounding.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call"})

# Compiled programs by their text, types, trees and devices: a second Trainer
# of the same shapes in a process compiles nothing, as op by op it would not.
_compiled: collections.OrderedDict = collections.OrderedDict()
_KEPT = 32


def made_at_once(fn: Callable, *args) -> Any:
    """`fn(*args)`, as one compiled program where that gives exactly the
    op-by-op result (see the module's docstring), else called as written,
    after a trace: its Python then runs twice."""
    try:
        traced = jax.jit(fn).trace(*args)
    except Exception:  # noqa: BLE001 - run as written: it raises its own error, if any
        return fn(*args)
    jaxpr = traced.jaxpr.jaxpr
    if (jaxpr.effects or any(v.aval.weak_type for v in jaxpr.outvars)
            or any(_rounded(jaxpr, [False] * len(jaxpr.invars)))):
        return fn(*args)
    return _compile(traced, args)(*args)


def _compile(traced, args) -> Callable:
    lowered = traced.lower()
    if traced.jaxpr.consts or _holds_arrays(traced.jaxpr.jaxpr):
        return _build(lowered)  # values JAX may pass beside the text: not shared
    devices = tuple(sorted({d for a in jax.tree.leaves(args) if isinstance(a, jax.Array)
                            for d in a.devices()}, key=lambda d: (d.platform, d.id)))
    # The text leaves out inputs the program does not read: their types are
    # part of the key too, as the executable checks them.
    key = (lowered.as_text(debug_info=False), tuple(map(str, jax.tree.leaves(traced.in_avals))),
           traced.in_tree, traced.out_tree, devices)
    if key not in _compiled:
        _compiled[key] = _build(lowered)
        if len(_compiled) > _KEPT:
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return _compiled[key]


def _build(lowered) -> Callable:
    return lowered.compile()


def _holds_arrays(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` (or a program inside it) holds a constant array, which
    JAX may pass as a hidden argument instead of writing it in the text."""
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Literal) and np.ndim(v.val) > 0 for v in eqn.invars):
            return True
        if any(_holds_arrays(inner) for inner in _programs(eqn)):
            return True
    return any(isinstance(v, Literal) and np.ndim(v.val) > 0 for v in jaxpr.outvars)


def _rounded(jaxpr: Jaxpr, rounded_in: list[bool]) -> list[bool]:
    """Per output of `jaxpr`: whether an op that may round otherwise in one
    program made it, given which inputs such ops made (`rounded_in`)."""
    rounded = dict(zip(jaxpr.invars, rounded_in))

    def of(v):
        return False if isinstance(v, Literal) else rounded.get(v, False)

    for eqn in jaxpr.eqns:
        ins, inner = [of(v) for v in eqn.invars], _programs(eqn)
        if eqn.primitive.name in _CALLS and len(inner) == 1 and len(inner[0].invars) == len(ins):
            outs = _rounded(inner[0], ins)
        elif not inner and (_moves(eqn) or not any(map(_inexact, [*eqn.invars, *eqn.outvars]))):
            outs = [any(ins)] * len(eqn.outvars)
        else:  # arithmetic or a comparison on floats, a branch, a loop
            outs = [True] * len(eqn.outvars)
        rounded.update(zip(eqn.outvars, outs))
    return [of(v) for v in jaxpr.outvars]


def _moves(eqn) -> bool:
    """Whether `eqn` only moves values. A conversion rounds once in any program
    from a float of at most 32 bits; from an integer or a wider float, op by op
    goes through float32 first (rounding twice) where a folded constant does not."""
    if eqn.primitive.name != "convert_element_type":
        return eqn.primitive.name in _MOVES
    source, target = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    return not jnp.issubdtype(target, jnp.inexact) or (
        jnp.issubdtype(source, jnp.floating) and np.dtype(source).itemsize <= 4)


def _programs(eqn) -> list[Jaxpr]:
    """The programs an equation holds (a call's, a branch's, a loop's)."""
    found = []
    for param in eqn.params.values():
        for p in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(p, (ClosedJaxpr, Jaxpr)):
                found.append(p.jaxpr if isinstance(p, ClosedJaxpr) else p)
    return found


def _inexact(v) -> bool:
    return hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.inexact)
