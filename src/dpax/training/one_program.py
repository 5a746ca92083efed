"""A function run as one compiled program where that gives exactly what
running it op by op gives: the training state's start (`dpax.training.state`).

Op by op, each op of a new shape and dtype compiles a program of its own
(an optimizer's zeros, one per param shape, before the first step). In one
program XLA may round otherwise: it fuses arithmetic, folds constants with
exact math, and keeps the denormals its op-by-op kernels flush to zero
(`x == 0` then differs too). So a function goes through as one program only
when its trace shows none of that: every output made by moves (copy,
convert, reshape, broadcast), by ops on integers and keys alone, or by calls
of programs made so; no effects; no weakly typed output (a Python number,
which jit would make an array).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

# Ops whose outputs hold their inputs' values (a conversion rounds each element
# alone, to nearest, in any program).
_MOVES = frozenset({"copy", "convert_element_type", "reshape", "broadcast_in_dim"})
# Calls of one inner program, looked into; any other op that holds programs
# (a branch, a loop) counts as rounding.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call"})

# Compiled programs by their text, trees and devices: a second Trainer of the
# same shapes in a process compiles nothing, as op by op it would not.
_compiled: dict[tuple, Any] = {}


def made_at_once(fn: Callable, *args) -> Any:
    """`fn(*args)`, as one compiled program where that gives exactly the
    op-by-op result (see the module's docstring), else op by op from the
    same trace. A `fn` jit cannot trace (one that reads a value in Python)
    or that returns a Python number is called again, as written: its
    Python runs twice."""
    try:
        traced = jax.jit(fn).trace(*args)
    except Exception:  # noqa: BLE001 - run as written: it raises its own error, if any
        return fn(*args)
    closed = traced.jaxpr
    if any(v.aval.weak_type for v in closed.jaxpr.outvars):
        return fn(*args)
    if closed.jaxpr.effects or any(_rounded(closed.jaxpr, [False] * len(closed.jaxpr.invars))):
        out = jaxpr_as_fun(closed)(*jax.tree.leaves(args))  # the same ops, one by one
        return jax.tree.unflatten(traced.out_tree, [jnp.asarray(o) for o in out])
    return _compile(traced, args)(*args)


def _compile(traced, args) -> Callable:
    lowered = traced.lower()
    if traced.jaxpr.consts:  # values the text may not hold: not shared
        return lowered.compile()
    devices = tuple(sorted({d.id for a in jax.tree.leaves(args) if isinstance(a, jax.Array)
                            for d in a.devices()}))
    # The text leaves out inputs the program does not read: their types are
    # part of the key too, as the executable checks them.
    key = (lowered.as_text(debug_info=False), tuple(map(str, jax.tree.leaves(traced.in_avals))),
           str(traced.in_tree),
           str(traced.out_tree), devices)
    if key not in _compiled:
        _compiled[key] = lowered.compile()
    return _compiled[key]


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
        elif not inner and (eqn.primitive.name in _MOVES
                            or not any(map(_inexact, [*eqn.invars, *eqn.outvars]))):
            outs = [any(ins)] * len(eqn.outvars)
        else:  # arithmetic or a comparison on floats, a branch, a loop
            outs = [True] * len(eqn.outvars)
        rounded.update(zip(eqn.outvars, outs))
    return [of(v) for v in jaxpr.outvars]


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
