"""Handing the trained state back to the user's model at the end of every
`fit` call (NNX's in-place convention), at a price a call can pay each time.

`nnx.update(model, state)` after `nnx.state(model)`, with one `device_put`
copy per array, walks the model's graph twice and copies array by array:
NNX's graph walk visits every node and Variable in Python, and each
`device_put` is a call of its own, so a model of many arrays pays most of
its handback there. A user who calls `fit` once per epoch, and the bench's
repeats, pay it every call. Here NNX walks the model once; later calls find
its Variables by JAX's pytree walk, checked to be the very same objects, and
set their values; the copies are one compiled program.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from dpax.training.state import KEPT, SOWN


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _quick_walk(model: nnx.Module) -> list | None:
    """The model's Variables by JAX's pytree walk (NNX modules are pytrees),
    without the graph bookkeeping (shared references, paths) `nnx.state` does. None
    where the model is not a pytree of Variables (a module made with
    `pytree=False`). What the model sowed is not among them (`SOWN`)."""
    found = jax.tree.leaves(model, is_leaf=_is_variable)
    if not all(_is_variable(v) for v in found):
        return None
    return [v for v in found if not isinstance(v, SOWN)]


@jax.jit
def _copies(arrays: list[jax.Array]) -> list[jax.Array]:
    # A compiled program's outputs never alias its (undonated) inputs: one
    # launch for every array, where `device_put(..., may_alias=False)`
    # copies one at a time.
    return [a.copy() for a in arrays]


class ModelHandback:
    """Writes a trained `nnx.State` into one user model's Variables.

    The model's Variables are those `nnx.state` finds; `write` reuses them
    for as long as the model holds the very same Variable objects in the
    same places (a user who replaces a layer or a Variable between calls
    gets the full walk again, as `nnx.update` would do it)."""

    def __init__(self, model: nnx.Module):
        self.model = model
        self._seen: list | None = None  # the quick walk the targets below belong to
        self._targets: list[nnx.Variable] = []  # in `nnx.state`'s order
        self._treedef: Any = None  # `nnx.state`'s, to its arrays; None: use NNX's update
        self._calls = 0

    def write(self, state: nnx.State) -> None:
        """Set every Variable of the model to a copy of `state`'s array for
        it (a copy: the Trainer's next step donates its own buffers), on the
        device or sharding the model's array had."""
        self._calls += 1
        quick = _quick_walk(self.model)
        if quick is None:
            return _write_by_nnx(self.model, state)
        if not _same(quick, self._seen):
            self._walk(quick)
        if self._treedef is None:
            return _write_by_nnx(self.model, state)
        new = _own_copies(self._treedef.flatten_up_to(state),
                          [v.get_value() for v in self._targets], compiled=self._calls > 1)
        for v, x in zip(self._targets, new):
            v.set_value(x)

    def _walk(self, quick: list) -> None:
        """NNX's own walk. Its Variables are kept (with `quick`, the walk that
        finds them again) where each holds one leaf and `quick` sees every
        one of them; else `write` leaves the model to `nnx.update` until the
        quick walk changes."""
        current = nnx.state(self.model, KEPT)
        targets = jax.tree.leaves(current, is_leaf=_is_variable)
        leaves, treedef = jax.tree.flatten(current)
        usable = (len(leaves) == len(targets)
                  and {id(v) for v in quick} == {id(v) for v in targets})
        self._seen = quick
        self._targets, self._treedef = (targets, treedef) if usable else ([], None)


def _same(a: list, b: list | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _own_copies(new: list, old: list, compiled: bool = False) -> list:
    """`new`, with each leaf whose `old` value is a device array replaced by a
    copy placed as that one is. One compiled program where every array is
    already in place and this is not the model's first handback (a run that
    calls `fit` once should not pay for compiling it); else one `device_put`
    for every leaf (one call: a call per leaf pays Python's dispatch per leaf)."""
    new = list(new)
    at = [i for i, o in enumerate(old) if isinstance(o, jax.Array)]
    arrays, shardings = [new[i] for i in at], [old[i].sharding for i in at]
    if not arrays:
        return new
    if compiled and all(isinstance(a, jax.Array) and a.sharding == s  # not host arrays
                        for a, s in zip(arrays, shardings)):
        copies = _copies(arrays)
    else:
        copies = jax.device_put(arrays, shardings, may_alias=False)
    for i, x in zip(at, copies):
        new[i] = x
    return new


def _write_by_nnx(model: nnx.Module, state: nnx.State) -> None:
    """NNX's own walk and update, for any model."""
    old, treedef = jax.tree.flatten(nnx.state(model, KEPT))
    nnx.update(model, treedef.unflatten(_own_copies(treedef.flatten_up_to(state), old)))
