"""Which outputs of a per-device function can differ between devices.

A step's per-device function computes some values from its own rows of the
batch (a loss, a BatchNorm's batch statistics) and others from what every
device holds alike (the params, a constant buffer). A value of the second
kind needs no all-reduce, and averaging one anyway is not free of rounding:
three equal float32 values summed and divided by 3 give another value for
about one element in seven. A value of the first kind that is not combined
across devices makes N devices compute something one device does not.

`analyze` answers from the function's jaxpr: a value varies when it depends
on a per-device input or on the device's index, unless a collective over the
devices made it the same everywhere (`psum`, `pmax`, `pmin`, `all_gather`).
The answer errs on the side of "varies": a while loop whose input varies
is taken to vary in every output.

It also finds the other way a device computes what one device
does not: random numbers drawn from a key every device holds alike, in a
shape that follows the device's rows (a drop-path mask drawn from the
model's own `nnx.Rngs`): each device then draws the same numbers for other
examples, and one device draws other numbers altogether.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

# Collectives whose every device gets the same result.
_SAME_EVERYWHERE = {"psum", "psum_invariant", "pmax", "pmin", "all_gather",
                    "all_gather_invariant"}
# Primitives whose result differs per device whatever their inputs.
_PER_DEVICE = {"axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter"}


def analyze(fn: Callable, args: Sequence[Any], per_device: Sequence[bool], axis: str,
            size: int, *, draws: bool = False, jaxpr: jcore.Jaxpr | None = None
            ) -> tuple[list[bool], list[tuple]]:
    """What of `fn(*args)` can differ between the `size` devices of `axis`
    when the arguments marked in `per_device` do (their leading axis: the
    device's rows). Returns, for each output leaf (`jax.tree.leaves` order),
    whether it can, and with `draws` the shapes of the random draws from a
    key that is the same on every device whose shape follows the rows: those
    of a second trace, with twice the rows, that differ (a function that
    cannot take twice the rows is not judged). `args` may be arrays, tracers
    or ShapeDtypeStructs; nothing is computed. `jaxpr`: `trace(fn, args,
    axis, size)`, where the caller has it already."""
    shapes = _shapes(args)
    found: list = []
    jaxpr = trace(fn, args, axis, size) if jaxpr is None else jaxpr
    flags = _propagate(jaxpr, leaf_flags(args, per_device), axis, found)
    if not draws or all(keyed for _, keyed in found):
        return flags, []
    more = [jax.tree.map(lambda a: jax.ShapeDtypeStruct((2 * a.shape[0],) + a.shape[1:], a.dtype)
                         if a.ndim else a, arg) if flag else arg
            for arg, flag in zip(shapes, per_device)]
    try:
        doubled = trace(fn, more, axis, size)
    except Exception:  # e.g. a reshape to a fixed batch size: no answer either way
        return flags, []
    found_more: list = []
    _propagate(doubled, leaf_flags(more, per_device), axis, found_more)
    if len(found) != len(found_more):  # not the same program: cannot pair them
        return flags, []
    return flags, [shape for (shape, keyed), (other, _) in zip(found, found_more)
                   if not keyed and shape != other]


def _shapes(args: Sequence[Any]) -> list:
    return [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arg) for arg in args]


def trace(fn: Callable, args: Sequence[Any], axis: str, size: int) -> jcore.Jaxpr:
    """`fn`'s jaxpr on the shapes of `args`, inside `size` devices of `axis`."""
    return jax.make_jaxpr(fn, axis_env=[(axis, size)])(*_shapes(args)).jaxpr


def leaf_flags(args: Sequence[Any], flags: Sequence[bool]) -> list[bool]:
    """Each argument's flag, once per leaf: the jaxpr's inputs."""
    return [flag for arg, flag in zip(args, flags) for _ in jax.tree.leaves(arg)]


def _propagate(jaxpr: jcore.Jaxpr, in_flags: list[bool], axis: str,
               draws: list | None = None) -> list[bool]:
    """The varying flags of `jaxpr`'s outputs; appends each random draw's
    (shape, whether its key varies) to `draws`, in program order."""
    varying: set = {v for v, f in zip(jaxpr.invars, in_flags) if f}

    def is_varying(atom) -> bool:
        return not isinstance(atom, jcore.Literal) and atom in varying

    for eqn in jaxpr.eqns:
        ins = [is_varying(a) for a in eqn.invars]
        if eqn.primitive.name == "random_bits" and draws is not None:
            draws.append((tuple(eqn.params["shape"]), ins[0]))
        outs = _eqn(eqn, ins, axis, draws)
        varying.update(v for v, f in zip(eqn.outvars, outs) if f)
    return [is_varying(v) for v in jaxpr.outvars]


def _eqn(eqn, ins: list[bool], axis: str, draws: list | None) -> list[bool]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in _PER_DEVICE:
        return [True] * n_out
    if name in _SAME_EVERYWHERE and axis in _axes(eqn.params):
        return [False] * n_out
    inner = [p for p in eqn.params.values() if isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr))]
    if name == "cond":  # the branch index, then the operands of every branch
        branches = eqn.params["branches"]
        per_branch = [_propagate(b.jaxpr, ins[1:], axis, draws) for b in branches]
        return [ins[0] or any(b[i] for b in per_branch) for i in range(n_out)]
    if name == "scan":  # consts, carry, xs -> carry, ys: until the carry's flags settle
        body, n_consts, n_carry = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], \
            eqn.params["num_carry"]
        flags = list(ins)
        while True:
            outs = _propagate(body, flags, axis)
            carry = [a or b for a, b in zip(flags[n_consts:n_consts + n_carry], outs[:n_carry])]
            if carry == flags[n_consts:n_consts + n_carry]:
                return _propagate(body, flags, axis, draws)
            flags[n_consts:n_consts + n_carry] = carry
    if (name != "while" and len(inner) == 1
            and len(_jaxpr(inner[0]).invars) == len(ins)
            and len(_jaxpr(inner[0]).outvars) == n_out):
        # A call (pjit, remat, custom_jvp/vjp): its body, argument for argument.
        return _propagate(_jaxpr(inner[0]), ins, axis, draws)
    return [any(ins)] * n_out


def _jaxpr(j) -> jcore.Jaxpr:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _axes(params: dict) -> tuple:
    axes = params.get("axes", params.get("axis_name", ()))
    return axes if isinstance(axes, tuple) else (axes,)


def typed_varying(x, axis: str) -> bool:
    """Does JAX type `x` as varying over `axis` (shard_map's `check_vma`)?
    Such a value is returned as replicated only through a collective. Where
    this JAX's types cannot be read, True: a collective is never wrong."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # JAX 0.7-0.9
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)  # JAX 0.10
    return True if vma is None else axis in vma
