"""A function run as one compiled program where that gives exactly what
running it op by op gives: the training state's start (`dpax.training.state`).

Op by op, each op of a new shape and dtype compiles a program of its own
(an optimizer's zeros, one per param shape, before the first step). In one
program XLA may give other bits wherever it computes: it fuses arithmetic,
folds constants with exact math and one rounding, keeps the denormals and
NaN payloads its op-by-op kernels flush. So a function goes through as one
program only when it computes nothing: every output is zeros or one of its
inputs moved (copied, reshaped, converted), no effects, no weakly typed
output. Adam's moments and counters and an EMA's copy of the params are
such; any other function runs as written.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Ops whose outputs hold their inputs' values. A conversion of an input runs
# the same kernel in one program as op by op; of a constant, it is folded.
_MOVES = frozenset({"copy", "reshape", "broadcast_in_dim", "convert_element_type"})
# Calls of one inner program, looked into.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call"})
ZERO, INPUT, OTHER = "zero", "input", "other"

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
            or OTHER in _kinds(jaxpr, [INPUT] * len(jaxpr.invars))):
        return fn(*args)
    return _compile(traced, args)(*args)


def _compile(traced, args) -> Callable:
    lowered = traced.lower()
    if traced.jaxpr.consts or _holds_arrays(traced.jaxpr.jaxpr):
        return _build(lowered)  # values JAX may pass beside the text: not shared
    devices = tuple(sorted({d for a in jax.tree.leaves(args) if isinstance(a, jax.Array)
                            for d in a.devices()}, key=lambda d: (d.platform, d.id)))
    # Beside the text: the input types (the text leaves out inputs it does not
    # read, and the executable checks them), the output types (a key's impl),
    # the trees as objects (two classes of one name differ) and as text
    # (metadata 1 and 1.0 compare equal).
    key = (lowered.as_text(debug_info=False), tuple(map(str, jax.tree.leaves(traced.in_avals))),
           tuple(str(v.aval) for v in traced.jaxpr.jaxpr.outvars), str(traced.in_tree),
           str(traced.out_tree), traced.in_tree, traced.out_tree, devices,
           str(jax.config.jax_default_device))  # where a program without inputs runs
    try:
        if key not in _compiled:
            _compiled[key] = _build(lowered)
            if len(_compiled) > _KEPT:
                _compiled.popitem(last=False)
        _compiled.move_to_end(key)
        return _compiled[key]
    except (TypeError, ValueError):  # metadata that cannot be compared (an array)
        return _build(lowered)


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


def _kinds(jaxpr: Jaxpr, kinds_in: list[str]) -> list[str]:
    """Per output of `jaxpr`: ZERO (zeros), INPUT (an input moved) or OTHER
    (computed, or a constant other than zero), given its inputs' kinds."""
    kinds = dict(zip(jaxpr.invars, kinds_in))

    def of(v):
        if isinstance(v, Literal):
            return ZERO if _is_zero(v.val) else OTHER
        return kinds.get(v, OTHER)  # a constvar: a constant

    for eqn in jaxpr.eqns:
        ins, inner = [of(v) for v in eqn.invars], _programs(eqn)
        if eqn.primitive.name in _CALLS and len(inner) == 1 and len(inner[0].invars) == len(ins):
            outs = _kinds(inner[0], ins)
        elif eqn.primitive.name in _MOVES and not inner and len(ins) == 1:
            outs = ins * len(eqn.outvars)
            if ins == [ZERO] and not _holds_zero(eqn.outvars[0].aval.dtype):
                outs = [OTHER]  # e.g. float8_e8m0fnu, which has no zero
        else:
            outs = [OTHER] * len(eqn.outvars)
        kinds.update(zip(eqn.outvars, outs))
    return [of(v) for v in jaxpr.outvars]


def _is_zero(value) -> bool:
    """A scalar of all-zero bytes that is zero (not -0.0): the same bits
    however it is made."""
    a = np.asarray(value)
    return a.ndim == 0 and not a.tobytes().strip(b"\0") and bool(a == 0)


def _holds_zero(dtype) -> bool:
    """Whether `dtype` holds zero as all-zero bytes, so that a zero converted
    to it is zero on either path."""
    try:
        return _is_zero(np.zeros((), dtype))
    except TypeError:  # not a NumPy type (a key)
        return False


def _programs(eqn) -> list[Jaxpr]:
    """The programs an equation holds (a call's, a branch's, a loop's)."""
    found = []
    for param in eqn.params.values():
        for p in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(p, (ClosedJaxpr, Jaxpr)):
                found.append(p.jaxpr if isinstance(p, ClosedJaxpr) else p)
    return found
