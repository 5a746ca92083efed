"""Weight gradients that XLA:CPU computes with its fast dot kernels.

JAX differentiates `y = x @ w` into a weight gradient `transpose(dot(dy, x))`.
XLA's algebraic simplifier folds such a transpose into the dot, which leaves
a dot contracting its lhs's first dimension. YNNPACK, which runs XLA:CPU's
other dots multi-threaded, refuses that dot, so every weight gradient of a
per-device (shard_map or pmap) step runs as a plain Eigen dot. In a `jit`
step that XLA partitions itself, the all-reduce sits between the dot and the
transpose and the fold never happens: that is why such a step was faster.

`keep_untransposed(f)` runs `f` with an `optimization_barrier` between each
dot and the transpose of its result, so the dot stays a YNNPACK dot and the
transpose a cheap copy. The barrier changes no value (measurements:
benchmarks/README.md, "The GPT against jit + NamedSharding").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var, subjaxprs


def keep_untransposed(f: Callable) -> Callable:
    """`f` with every `transpose(dot_general(...))` kept apart by a barrier;
    the same values. `f` is traced once more; where it has no such pair it
    runs as it is, so its program stays exactly what it was."""

    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(f, return_shape=True)(*args)
        if not _has_folded_pair(closed.jaxpr):
            return f(*args)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def _is_pair(eqn, made_by: dict) -> bool:
    return eqn.primitive.name == "transpose" and made_by.get(eqn.invars[0]) == "dot_general"


def _has_folded_pair(jaxpr: Jaxpr) -> bool:
    made_by = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    return any(_is_pair(e, made_by) for e in jaxpr.eqns) or any(
        _has_folded_pair(sub) for sub in subjaxprs(jaxpr))


def _eval(jaxpr: Jaxpr, consts: list, args: list) -> list:
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    made_by: dict[Var, str] = {}  # which primitive produced each value here

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "jit" and isinstance(eqn.params.get("jaxpr"), ClosedJaxpr):
            # Inline nested jits, so that their dots get the barrier too (XLA
            # inlines them anyway).
            sub = eqn.params["jaxpr"]
            outs = _eval(sub.jaxpr, sub.consts, ins)
        elif (name == "remat2" and isinstance(eqn.params.get("jaxpr"), Jaxpr)
              and not eqn.params["jaxpr"].constvars):
            # A checkpointed block's backward pass (`jax.checkpoint`): inlined as
            # its own lowering does, behind the barrier that keeps XLA from
            # reusing the forward pass's values (what remat saves memory by).
            outs = _eval(eqn.params["jaxpr"], [], _remat_barrier(ins, eqn.params))
        else:
            if _is_pair(eqn, made_by):
                ins[0] = jax.lax.optimization_barrier(ins[0])
            # The equation's own source info: op names in profiles stay the model's.
            names = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
                  eqn.ctx.manager):
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
            made_by[v] = name
    return [read(v) for v in jaxpr.outvars]


def _remat_barrier(ins: list, params: dict) -> list:
    """The arguments of a checkpoint as its lowering passes them (JAX's
    `_remat_lowering`): those it prevents CSE on go through one barrier."""
    cse = params["prevent_cse"]
    cse = (cse,) * len(ins) if isinstance(cse, bool) else cse
    if not params["differentiated"] or not any(cse):
        return ins
    picked = [i for i, c in enumerate(cse) if c]
    held = jax.lax.optimization_barrier([ins[i] for i in picked])
    out = list(ins)
    for i, v in zip(picked, held):
        out[i] = v
    return out
