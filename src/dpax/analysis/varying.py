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

from dpax.analysis.propagate import Domain, leaf_flags, names, propagate, shapes, trace


class Varying(Domain):
    """A fact per value: can it differ between the devices of `axis`?"""

    bottom = False

    def __init__(self, axis: str):
        self.axis = axis

    def join(self, facts: list) -> bool:
        return any(facts)

    def primitive(self, eqn, facts: list) -> list:
        return [any(facts)] * len(eqn.outvars)

    def per_device(self, eqn, facts: list) -> list:
        return [True] * len(eqn.outvars)

    def collective(self, eqn, facts: list, over_axis: bool) -> list:
        return [False] * len(eqn.outvars) if over_axis else self.primitive(eqn, facts)


def varying(jaxpr: jcore.Jaxpr, in_flags: Sequence[bool], axis: str,
            draws: list | None = None, observe=None) -> list[bool]:
    """Whether each output of `jaxpr` can differ between devices; appends
    each random draw's (shape, whether its key varies) to `draws`, in
    program order. `observe(eqn, flags)` sees every equation with whether
    each operand can differ."""
    if draws is not None:
        def observe(eqn, facts, inner=observe):
            if eqn.primitive.name == "random_bits":
                # Each key's shape, after the shape of the keys: a batch of
                # keys split or folded per row (`vmap` over `random.split(key,
                # rows)`) draws in a shape that follows the rows as well.
                keys = tuple(getattr(eqn.invars[0].aval, "shape", ()))
                draws.append((keys + tuple(eqn.params["shape"]), facts[0]))
            if inner is not None:
                inner(eqn, facts)
    return propagate(jaxpr, list(in_flags), Varying(axis), observe)


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
    found: list = []
    jaxpr = trace(fn, args, axis, size).jaxpr if jaxpr is None else jaxpr
    flags = varying(jaxpr, leaf_flags(args, per_device), axis, found)
    if not draws or all(keyed for _, keyed in found):
        return flags, []
    more = [jax.tree.map(lambda a: jax.ShapeDtypeStruct((2 * a.shape[0],) + a.shape[1:], a.dtype)
                         if a.ndim else a, arg) if flag else arg
            for arg, flag in zip(shapes(args), per_device)]
    try:
        doubled = trace(fn, more, axis, size).jaxpr
    except Exception:  # e.g. a reshape to a fixed batch size: no answer either way
        return flags, []
    found_more: list = []
    varying(doubled, leaf_flags(more, per_device), axis, found_more)
    if len(found) != len(found_more):  # not the same program: cannot pair them
        return flags, []
    return flags, [shape for (shape, keyed), (other, _) in zip(found, found_more)
                   if not keyed and shape != other]


def typed_varying(x, axis: str) -> bool:
    """Does JAX type `x` as varying over `axis` (shard_map's `check_vma`)?
    Such a value is returned as replicated only through a collective. Where
    this JAX's types cannot be read, True: a collective is never wrong."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # JAX 0.7-0.9
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)  # JAX 0.10
    return True if vma is None else any(a in vma for a in names(axis))
