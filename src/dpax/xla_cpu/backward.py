"""The backward pass rewritten for what XLA:CPU compiles well; the same math.

Three things in a JAX gradient make XLA:CPU slow or memory-hungry:

- **Weight gradients.** JAX differentiates `y = x @ w` over [batch, tokens,
  features] into `transpose(dot(dy, x))`. XLA's algebraic simplifier folds the
  transpose into the dot, which leaves a dot contracting its lhs's first
  dimension. YNNPACK, which runs XLA:CPU's other dots multi-threaded, refuses
  that dot, so each weight gradient of a per-device (shard_map or pmap) step
  ran as a plain Eigen dot. In a `jit` step that XLA partitions itself the
  all-reduce sits between the dot and the transpose and the fold never
  happens: that is why such a step was faster. Here an `optimization_barrier`
  keeps each such pair apart, so the dot stays a YNNPACK dot, where its
  shapes were timed faster so (`dpax.xla_cpu.dots`): the transpose is a copy
  of the gradient, which costs more than the dot saves when few tokens
  contract (a large model on a small batch).

- **Checkpointed blocks** (`jax.checkpoint`, e.g. `GPT(remat=...)`). JAX keeps
  XLA from merging a block's recomputation with its forward pass by an
  `optimization_barrier`; XLA:CPU expands barriers before its last
  common-subexpression passes, which then merge the two again, and every
  activation stays live: remat saved no memory (jax-ml/jax#19822). Here the
  recomputation runs in a conditional whose predicate XLA cannot know (JAX's
  own earlier lowering of remat): it cannot be merged, and it cannot start
  before the block's cotangent exists.

- **Max pooling.** The gradient of `reduce_window_max` is a
  `select_and_scatter_add`, which XLA:CPU runs as a loop over windows, most
  of a small conv net's step. Where windows do not overlap (the usual 2x2
  stride 2), each element belongs to one window, and the scatter is a choice:
  a one-hot of each window's first max times its cotangent (the same bits).
  The pool itself becomes a max over the window axes of a reshape, so the
  step keeps no windowed op.

The pools keep their bits. A weight gradient whose dot now runs on another
kernel can round differently in the last bits; nothing else changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var, subjaxprs

from dpax.dense_grads import transposed_dot
from dpax.xla_cpu import dots


def for_xla_cpu(f: Callable) -> Callable:
    """`f` (a function that takes gradients) with both rewrites; the same
    values. `f` is traced once more; where it has nothing to rewrite it runs
    as it is, so its program stays exactly what it was."""

    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(f, return_shape=True)(*args)
        if not _rewrites(closed.jaxpr):
            return f(*args)
        try:
            outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        except Exception as e:  # noqa: BLE001 - a speed-up must never block training
            warnings.warn(f"dpax: the XLA:CPU backward-pass rewrite does not apply to this "
                          f"model ({type(e).__name__}: {e}); training without it", stacklevel=2)
            return f(*args)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def _is_folded_pair(eqn, made_by: dict) -> bool:
    dot = transposed_dot(eqn, made_by)
    if dot is None:
        return False
    # Which is faster depends on the shapes, not the op, so each shape is timed
    # (`dpax.xla_cpu.dots`). A 2-D dense layer's weight gradient: a wide
    # layer's folded dot is the faster, a narrow head's the slower. A dot that
    # contracts several dimensions (batch and tokens) is usually faster kept
    # apart, but with few tokens a wide model's transposes cost more than its
    # dots, so it is timed too, with the smaller margin.
    (contracting, _), _ = dot.params["dimension_numbers"]
    margin = dots.MARGIN_SEVERAL if len(contracting) > 1 else dots.MARGIN
    lhs, rhs = (v.aval for v in dot.invars)
    return dots.keep_apart(lhs, rhs, dot.params, tuple(eqn.params["permutation"]), margin)


def _is_recomputation(eqn) -> bool:
    """A checkpointed block as differentiation leaves it: recomputed in the
    backward pass (`remat2` is `jax.checkpoint`'s primitive)."""
    sub = eqn.params.get("jaxpr")
    return (eqn.primitive.name == "remat2" and eqn.params.get("differentiated", False)
            and isinstance(sub, Jaxpr) and not sub.constvars)


def _is_pool_gradient(eqn) -> bool:
    """Max (or min) pooling's gradient over windows that do not overlap and
    need no padding: each input element gets the cotangent of at most one
    window, so scattering is just choosing."""
    return (eqn.primitive.name == "select_and_scatter_add"
            and eqn.params["select_prim"] in (lax.ge_p, lax.le_p) and _tiles(eqn.params))


def _tiles(p) -> bool:
    """Windows that do not overlap, need no padding and are not dilated."""
    return (tuple(p["window_dimensions"]) == tuple(p["window_strides"])
            and all(lo == hi == 0 for lo, hi in p["padding"])
            and set(p.get("base_dilation", (1,))) | set(p.get("window_dilation", (1,))) == {1})


def _split(operand, out, win):
    """The part of `operand` that whole windows cover, as [o0, w0, o1, w1, ...]."""
    covered = operand[tuple(slice(0, o * w) for o, w in zip(out, win))]
    return covered, covered.reshape([d for o, w in zip(out, win) for d in (o, w)])


_POOLS = {"reduce_window_max": jnp.max, "reduce_window_min": jnp.min}


def _is_pool(eqn) -> bool:
    return eqn.primitive.name in _POOLS and _tiles(eqn.params)


def _pool(operand, *, name, window_dimensions, **_):
    """A max (min) pool over windows that do not overlap: a reduction over the
    window axes of a reshape, the same values (max picks, it does not round)."""
    win = tuple(window_dimensions)
    _, split = _split(operand, tuple(d // w for d, w in zip(operand.shape, win)), win)
    return _POOLS[name](split, axis=tuple(range(1, 2 * len(win), 2)))


def _pool_gradient(source, operand, *, select_prim, window_dimensions, **_):
    """`select_and_scatter_add` for non-overlapping windows, as XLA defines it:
    each window's cotangent goes to its first max (min for `le`) in row-major
    order, the rest get zero; elements no window covers get zero. Exact: one
    product by 1 or 0 per element and no sums."""
    win = tuple(window_dimensions)
    out = source.shape  # whole windows per dimension
    rank = len(win)
    covered, split = _split(operand, out, win)
    # [o0, w0, o1, w1, ...] -> [o0, o1, ..., w0, w1, ...] -> [o..., prod(w)]
    to_windows = [2 * i for i in range(rank)] + [2 * i + 1 for i in range(rank)]
    windows = split.transpose(to_windows).reshape(out + (-1,))
    pick = jnp.argmax if select_prim is lax.ge_p else jnp.argmin  # the first on ties
    chosen = jax.nn.one_hot(pick(windows, axis=-1), windows.shape[-1], dtype=source.dtype)
    grads = (chosen * source[..., None]).reshape(out + win)
    grads = grads.transpose([i for pair in zip(range(rank), range(rank, 2 * rank))
                             for i in pair]).reshape(covered.shape)
    return jnp.pad(grads, [(0, d - c) for d, c in zip(operand.shape, covered.shape)])


def _rewrites(jaxpr: Jaxpr) -> bool:
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    here = any(_is_folded_pair(e, made_by) or _is_recomputation(e) or _is_pool_gradient(e)
               or _is_pool(e) for e in jaxpr.eqns)
    return here or any(_rewrites(sub) for sub in subjaxprs(jaxpr))


def _eval(jaxpr: Jaxpr, consts: list, args: list) -> list:
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    made_by: dict[Var, Any] = {}  # the equation that produced each value here

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "jit" and isinstance(eqn.params.get("jaxpr"), ClosedJaxpr):
            # Inlined, so that its dots are rewritten too (XLA inlines it anyway).
            sub = eqn.params["jaxpr"]
            outs = _eval(sub.jaxpr, sub.consts, ins)
        elif _is_recomputation(eqn):
            outs = _recompute(eqn.params["jaxpr"], ins)
        else:
            if _is_folded_pair(eqn, made_by):
                ins[0] = jax.lax.optimization_barrier(ins[0])
            # The equation's own source info: op names in profiles stay the model's.
            names = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
                  eqn.ctx.manager):
                if _is_pool_gradient(eqn):
                    outs = _pool_gradient(*ins, **eqn.params)
                elif _is_pool(eqn):
                    outs = _pool(*ins, name=name, **eqn.params)
                else:
                    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
            made_by[v] = eqn
    return [read(v) for v in jaxpr.outvars]


def _recompute(jaxpr: Jaxpr, ins: list) -> list:
    """A checkpointed block's recomputation and backward pass, in a conditional
    XLA cannot see through: a uniform draw in [0, 1) is always below 2."""
    def branch(*a):
        return _eval(jaxpr, [], list(a))

    always = jax.lax.rng_uniform(0.0, 1.0, ()) < 2.0
    return jax.lax.cond(always, branch, branch, *ins)
