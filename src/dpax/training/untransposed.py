"""Weight gradients summed over the devices before their last transpose, where
XLA's own partitioner sums them.

JAX differentiates `y = x @ w`, for `x` of shape [batch, tokens, features],
into `transpose(dot(dy, x))` for `w`. In a `jit` step with a sharded batch,
XLA's partitioner all-reduces the dot's partial result and transposes the
sum. In a per-device step (shard_map, pmap) the all-reduce comes after the
whole gradient, and XLA's algebraic simplifier folds the transpose into the
dot: a dot contracting its operands' leading dimensions, batch and tokens,
which XLA:CPU runs on a slower kernel than the plain dot and the transpose
(the GPT's generic step fell behind jit + NamedSharding's by that dot).

So the step's gradient function leaves such a gradient untransposed, the
layout sums it so, and `transposes` puts it back after the sum. A transpose
only moves elements and a dtype conversion acts on each one: every element
is summed from the same terms as before.

A 2-D dense layer's gradient ([batch, features]) folds into a plain matmul
with one operand transposed, which is what the pmap loop runs: it stays so,
unless the layer is narrow. On XLA:CPU the folded form is the faster one
for wide layers: a plain matmul kernel reads the transposed operand in
place. For a layer of at most `NARROW` outputs, a classifier's head, the
folded dot writes a result only that many columns wide, which XLA:CPU runs
on a slow kernel: the unfolded dot and its transpose are faster there for
the heads of the bench's models, though not for every narrow shape. jit
with a sharded batch sums such a head before the transpose, so moving it
makes the generic step run as jit's does. Either form is one all-reduce of
the same bytes: other platforms get the placement jit's partitioner gives
them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun

from dpax.dense_grads import producer, transposed_dot

# Per gradient leaf: None (returned as it is), or the permutation left out
# and the dtype the leaf is converted to (None: the dot's own).
Moved = tuple[tuple[int, ...], Any] | None

# A 2-D gradient whose last dimension (its folded dot's columns) is at most
# this is summed before the transpose too (see the module's docstring).
NARROW = 32
# ... and one of at least this many multiply-adds is read untransposed by the
# guard's norm on one device (`ReduceBeforeTranspose.for_norm`).
HEAD_MACS = 1 << 20


class ReduceBeforeTranspose:
    """For one step's trace: `wrap` a `jax.value_and_grad(f)` so that its
    transposed-dot gradients come out untransposed; `transposes` undoes it
    once they are summed over the devices."""

    def __init__(self):
        self.moved: list[Moved] | None = None  # known once a wrapped function is traced
        self.heads: list[bool] = []  # per gradient: a large narrow head's (`for_norm`)

    def wrap(self, grad_fn: Callable) -> Callable:
        def wrapped(wrt):
            return self.call(*jax.make_jaxpr(grad_fn, return_shape=True)(wrt), wrt)

        return wrapped

    def call(self, closed: ClosedJaxpr, out_shape, wrt, *rest):
        """The traced `value_and_grad` `closed` (with `out_shape`, from
        `jax.make_jaxpr(..., return_shape=True)`) called on `(wrt, *rest)`,
        its gradients by `wrt` with the transposed-dot ones left untransposed."""
        outvars, moved, heads = _untransposed(closed.jaxpr, len(jax.tree.leaves(wrt)))
        # Micro-batches trace the same function: they must agree.
        if self.moved is not None and moved != self.moved:
            raise AssertionError("micro-batch gradients traced differently")
        self.moved, self.heads = moved, heads
        outs = jaxpr_as_fun(ClosedJaxpr(closed.jaxpr.replace(outvars=outvars),
                                        closed.consts))(*jax.tree.leaves((wrt, *rest)))
        first = len(outs) - len(moved)
        outs[first:] = [out if m is None or m[1] is None else out.astype(m[1])
                        for out, m in zip(outs[first:], moved)]
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    def transposes(self, grads):
        """The params' gradients from summed ones as `wrap`'s function gave them."""
        if not self.moved or not any(self.moved):
            return grads
        leaves, treedef = jax.tree.flatten(grads)
        return jax.tree.unflatten(treedef, [
            g if m is None else g.transpose(m[0])
            for g, m in zip(leaves, self.moved, strict=True)])


    def for_norm(self, summed):
        """The summed gradients as a norm over them reads them (None: as
        `transposes` gives them): a large narrow head's as its dot gave it.

        On N > 1 devices the all-reduce keeps such a dot apart from its
        transpose; on one device nothing does, and XLA folds the two. A dot
        whose own result is read cannot be folded, and the guard's norm reads
        every gradient: reading the head's there keeps its dot unfolded on one
        device too, as on N (the result is a few thousand elements: nothing
        to transpose on any platform, and on XLA:CPU the folded narrow dot
        is the slow kernel above). Only from `HEAD_MACS`: a smaller head,
        unfolded, is handed to XLA:CPU's thread pool, whose dispatch costs
        more than a tiny model's whole step. Wider dots are left to XLA:
        whether a transformer's runs faster unfolded depends on its shapes
        (it did on the bench's GPT, not on a wide one with few tokens)."""
        if not any(self.heads):
            return None
        leaves, treedef = jax.tree.flatten(summed)
        return jax.tree.unflatten(treedef, [
            g if head or m is None else g.transpose(m[0])
            for g, m, head in zip(leaves, self.moved, self.heads, strict=True)])


def _untransposed(jaxpr: Jaxpr, n_grads: int) -> tuple[list, list[Moved], list[bool]]:
    """The outputs, each of the last `n_grads` (the gradients) that is a
    transpose of a dot contracting several dimensions, or of a narrow 2-D one,
    replaced by the dot; and per gradient, whether it is such a narrow one of
    at least `HEAD_MACS` multiply-adds."""
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    outvars = list(jaxpr.outvars)
    moved: list[Moved] = []
    heads: list[bool] = []
    for i in range(len(outvars) - n_grads, len(outvars)):
        var, dtype = outvars[i], None
        eqn = producer(var, made_by)
        if eqn is not None and eqn.primitive.name == "convert_element_type":
            # A bf16 compute dtype: the gradient converted back to the param's dtype.
            var, dtype = eqn.invars[0], eqn.params["new_dtype"]
            eqn = producer(var, made_by)
        dot = None if eqn is None else transposed_dot(eqn, made_by)
        narrow = var.aval.ndim == 2 and var.aval.shape[1] <= NARROW
        if dot is None or not (len(dot.params["dimension_numbers"][0][0]) >= 2 or narrow):
            moved.append(None)
            heads.append(False)
            continue
        outvars[i] = eqn.invars[0]
        moved.append((tuple(eqn.params["permutation"]), dtype))
        (contracted, _), _ = dot.params["dimension_numbers"]
        macs = math.prod(dot.outvars[0].aval.shape) * math.prod(
            dot.invars[0].aval.shape[d] for d in contracted)
        heads.append(narrow and macs >= HEAD_MACS)
    return outvars, moved, heads
