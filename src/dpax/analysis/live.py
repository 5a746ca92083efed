"""The part of a jaxpr that its outputs need.

The refusals judge what the forward computes for what it returns: the
loss, the sums, the new model state. An equation whose result reaches none
of them changes nothing that N devices train: a `jax.debug.print` of the
batch's mean loss prints each device's own mean, and a value computed and
left unused is never read. Both are left out before the analyses read the
jaxpr, so neither is refused. Other effects (a write to a ref, a host
callback) are kept, with all they read.
"""

from __future__ import annotations

from jax.extend import core as jcore

# The effects of `jax.debug.print` and `jax.debug.callback`, which observe
# and return nothing, by their classes' names (JAX keeps them private). An
# equation with an effect of any other kind is kept (a write to a ref that a
# kept read then sees), as is all it reads: a name JAX changes keeps a
# print, judged as before.
_PASSING = frozenset({"DebugEffect", "OrderedDebugEffect"})


def live(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """`closed` without the equations its outputs do not need, debug
    prints and callbacks included, in its sub-jaxprs too (their inputs and outputs
    kept). Its inputs, outputs and constants are unchanged; it is for
    reading, not running (its effects are the original's)."""
    return jcore.ClosedJaxpr(_live(closed.jaxpr), closed.consts)


def _live(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    needed = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars) or _lasting(eqn):
            kept.append(_with_live_bodies(eqn, needed))
            needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return jaxpr.replace(eqns=kept[::-1])


def _lasting(eqn) -> bool:
    return any(type(e).__name__ not in _PASSING for e in eqn.effects)


def _with_live_bodies(eqn, needed: set):
    """`eqn` with each sub-jaxpr in its params (a call's, a scan's, a cond's
    branches) made live for all its outputs, and the outputs nothing needs
    dropped (`DropVar`: a scan's carry left unread)."""
    return eqn.replace(
        params={k: _body(v) for k, v in eqn.params.items()},
        outvars=[v if v in needed else jcore.DropVar(v.aval) for v in eqn.outvars])


def _body(value):
    if isinstance(value, jcore.ClosedJaxpr):
        return live(value)
    if isinstance(value, jcore.Jaxpr):
        return _live(value)
    if isinstance(value, tuple) and any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))
                                        for v in value):
        return tuple(_body(v) for v in value)
    return value
