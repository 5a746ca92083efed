"""What examples must be before a step runs, checked on the host.

Every array of the examples holds real numbers, one row per example, and
no NaN or infinity where it is float (`structure`, `values`). A loss may
declare more (`declare`): dpax's `classification_loss` takes integer class
ids below the model's number of outputs (`dpax.models.losses`); a loss of
one's own gets the checks every array gets.

The Trainer checks arrays in memory whole, one vectorised pass each, before
the first step; arrays read per batch (a `dpax.data.sources.Column`, a
`np.memmap`) and streamed batches are checked on their first batch. The
CLI's checks of a user's data (`dpax.data.datasets.labelled`) are these
functions too, its messages naming the file instead of an argument.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpax.errors import BadArgument, BadExamples, BadLabels, NotFinite, summary

Rule = Callable[["Examples"], None]  # a loss's own check of the examples it reads
_RULE = "dpax_batch_rule"  # where `declare` keeps a loss's rule


@dataclasses.dataclass(frozen=True)
class Examples:
    """Examples under check, and how a message names each array: by the
    argument that brought it, or by the file it came from.

    Attributes:
      arrays: the examples, a dict of arrays (values may be nested dicts).
      argument: the argument that holds them: `data` or `batches`.
      positional: given as arrays, not a dict: `x` is `data` itself, `y` is `y`.
      file: the file they were read from (the CLI's): messages name it.
      first_batch: only a stream's first batch is seen; every array is read.
      outputs: `outputs(shape, dtype)`, the model's output (a
        `jax.ShapeDtypeStruct`) for a batch of one example of that shape and
        dtype, from shapes alone; None where no model is known.
    """

    arrays: dict
    argument: str = "data"
    positional: bool = False
    file: str | None = None
    first_batch: bool = False
    outputs: Callable[[tuple, Any], jax.ShapeDtypeStruct] | None = None

    def name(self, *keys) -> str:
        """How a message names the array under `keys` (all of them: none)."""
        if self.file is not None:
            where = f"{self.file}: {'.'.join(map(str, keys))}" if keys else self.file
        elif self.positional and keys in (("x",), ("y",)):
            where = "`data`" if keys == ("x",) else "`y`"
        else:
            where = f"`{self.argument}`" + "".join(f"[{k!r}]" for k in keys)
        return f"the first batch of {where}" if self.first_batch else where

    def argument_of(self, key: str | None) -> str:
        """The argument (or file) that holds the array under `key`."""
        if self.file is not None:
            return self.file
        return "y" if self.positional and key == "y" else self.argument

    def leaves(self) -> list[tuple[tuple, Any]]:
        """(keys, array) of every array, nested containers flattened; a list
        is one array (a refused one: `structure`)."""
        flat = jax.tree_util.tree_flatten_with_path(
            self.arrays, is_leaf=lambda v: isinstance(v, list))[0]
        return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path), a)
                for path, a in flat]

    @property
    def read_whole(self) -> bool:
        """Whether every array is read here (none is left to a first batch)."""
        return all(self.readable(a) for _, a in self.leaves())

    def readable(self, a) -> bool:
        """Whether `a` is read whole here: in memory, or part of a first batch."""
        return self.first_batch or in_memory(a)

    def output_shape(self, key: str, shape: tuple | None = None) -> tuple[int, ...] | None:
        """The model's output shape for one example of the array under `key`
        (or of that array's dtype and `shape`), None where no model is known;
        a `BadExamples` naming the array when the model cannot take it."""
        if self.outputs is None:
            return None
        a = self.arrays[key]
        shape = tuple(a.shape[1:]) if shape is None else tuple(shape)
        try:
            return tuple(self.outputs(shape, a.dtype).shape[1:])
        except Exception as e:  # JAX raises TypeError, ValueError, ... from the model
            raise self.bad(BadExamples, f"the model cannot take {self.name(key)}: examples "
                           f"of shape {shape} and dtype {np.dtype(a.dtype)} "
                           f"({summary(e, 200)})", key) from None

    def bad(self, cls, message: str, key: str | None = None, **extra) -> Exception:
        return cls(message, self.argument_of(key), key, **extra)


def in_memory(a) -> bool:
    """Arrays held in memory: a NumPy array read whole costs no more than a
    pass. A memory map (or a `dpax.data.sources.Column`) would be read from disk."""
    return isinstance(a, (np.ndarray, jax.Array)) and not isinstance(a, np.memmap)


# -- every array ---------------------------------------------------------------------------
def structure(ex: Examples) -> int:
    """At least one array, each with a leading example axis of the same
    length > 0; returns that length."""
    leaves = ex.leaves()
    if not leaves:
        raise ex.bad(BadExamples, f"{ex.name()} is an empty dict; give at least one array")
    for keys, a in leaves:
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise ex.bad(BadExamples, f"{ex.name(*keys)} is a {type(a).__name__}; give an array "
                         "with one row per example (e.g. np.asarray)", keys[0])
        if len(a.shape) == 0:
            raise ex.bad(BadExamples, f"{ex.name(*keys)} is a scalar; give an array with one "
                         "row per example", keys[0])
    (keys, first), *rest = leaves
    for other, a in rest:
        if len(a) != len(first):
            raise ex.bad(BadExamples, f"the arrays differ in length: {ex.name(*other)} has "
                         f"{len(a)} rows, {ex.name(*keys)} {len(first)}; every array needs "
                         "one row per example", other[0])
    if not len(first):
        raise ex.bad(BadExamples, f"no examples: {ex.name()} has 0 rows")
    return len(first)


def values(ex: Examples) -> None:
    """Every array holds real numbers (or bools), and no NaN or infinity
    where it is float; an array not read here (`Examples.readable`) is
    checked by its dtype alone."""
    for keys, a in ex.leaves():
        dtype = np.dtype(a.dtype)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise ex.bad(BadExamples, f"{ex.name(*keys)} is complex ({dtype}); dpax trains on "
                         "real numbers, so give the parts you mean as real arrays", keys[0])
        if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
            raise ex.bad(BadExamples, f"{ex.name(*keys)} has non-numeric dtype {dtype}; give "
                         "numbers", keys[0])
        if jnp.issubdtype(dtype, jnp.floating) and ex.readable(a):
            finite(ex, keys, a)


def finite(ex: Examples, keys: tuple[str, ...], a) -> None:
    """No NaN or infinity in float array `a`: its sum is finite only if every
    term is, one pass with no array of flags; a sum that overflows is
    looked at element by element."""
    if np.isfinite(a.sum()):
        return
    bad = ~np.isfinite(np.asarray(a)).reshape(len(a), -1).all(axis=1)
    if bad.any():
        rows, first = int(bad.sum()), int(np.argmax(bad))
        raise ex.bad(NotFinite, f"{ex.name(*keys)} contains NaN or infinite values in {rows} "
                     f"of its {len(a)} examples (the first at row {first}); clean the data "
                     "first", keys[0], rows=rows, first=first)


def batch_size(value: Any, argument: str = "batch_size") -> None:
    """A batch size is a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise BadArgument(f"`{argument}` must be a whole number >= 1, got {value!r}", argument)


# -- what a loss reads -----------------------------------------------------------------------
def has_keys(ex: Examples, keys: tuple[str, ...], reader: str) -> None:
    """The examples hold every one of `keys`, which `reader` (a loss) reads."""
    missing = [k for k in keys if k not in ex.arrays]
    if missing:
        raise ex.bad(BadExamples, f"{reader} reads the keys {', '.join(map(repr, keys))} of "
                     f"each batch; {ex.name()} has {', '.join(map(repr, ex.arrays))}")


def ids(ex: Examples, key: str, *, ndim: int, below: int | None, what: str,
        reader: str, per_example: str, bound: Callable[[int], str] | None = None) -> None:
    """The array under `key` holds `what` (e.g. class ids): integers (or
    bools), `ndim` axes, each value in 0..`below`-1 (`bound(largest)` says
    what is over). Its values are read once for the least and the largest;
    a bool's are 0 and 1 by its dtype, whatever it holds."""
    y = ex.arrays[key]
    name, dtype = ex.name(key), np.dtype(y.dtype)
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        raise ex.bad(BadLabels, f"{name} holds {dtype} values, but {reader} takes integer "
                     f"{what}{_as_ids(y, ex.readable(y))}", key)
    if y.ndim != ndim:
        raise ex.bad(BadLabels, f"{name} has shape {tuple(y.shape)}, but {reader} takes "
                     f"{per_example}", key)

    def over(high):
        return bound(high) if bound else f"{reader} takes them below {below}"

    if dtype == np.bool_:
        if below is not None and below < 2:
            raise ex.bad(BadLabels, f"{name} holds bools, {what} 0 and 1, but {over(1)}", key)
        return
    if not ex.readable(y) or not len(y):
        return
    low, high = int(y.min()), int(y.max())
    if low < 0:
        raise ex.bad(BadLabels, f"{name} holds {what} below 0 (the least is {low}); "
                     f"{what} count from 0", key)
    if below is not None and high >= below:
        raise ex.bad(BadLabels, f"{name} holds {what} up to {high}, but {over(high)}", key)


def _as_ids(y, readable: bool) -> str:
    """How to turn float labels into class ids, when it can be seen: a
    one-hot (or probability) row per example, or whole numbers."""
    if not readable or not len(y):
        return ""
    y = np.asarray(y)
    if y.ndim == 2 and np.allclose(y.sum(-1), 1):
        return "; these rows look one-hot: give `y.argmax(-1)`"
    if y.ndim == 1 and np.all(np.mod(y, 1) == 0):
        return "; these are whole numbers: give `y.astype(np.int32)`"
    return ""


def per_example_size(ex: Examples, key: str, size: int, reader: str, of: str) -> None:
    """The array under `key` holds `size` values per example, as many as `of`."""
    y = ex.arrays[key]
    has = int(np.prod(y.shape[1:], dtype=np.int64))
    if has != size:
        raise ex.bad(BadLabels, f"{ex.name(key)} has {has} value(s) per example (shape "
                     f"{tuple(y.shape)}), but {of} {size}; {reader} compares them one to one",
                     key)


# -- a loss's rule ---------------------------------------------------------------------------
def declare(rule: Rule) -> Callable:
    """Decorator: the loss checks the examples it reads with `rule(examples)`
    before the first step (`rule_of` finds it)."""
    def mark(loss_fn):
        setattr(loss_fn, _RULE, rule)
        return loss_fn

    return mark


def rule_of(loss_fn: Callable) -> Rule | None:
    """The rule a loss declared (through `functools.partial`), or None."""
    while isinstance(loss_fn, functools.partial):
        loss_fn = loss_fn.func
    return getattr(loss_fn, _RULE, None)


def check(ex: Examples, rule: Rule | None = None) -> None:
    """`values`, then the loss's `rule`, of examples whose `structure` holds."""
    values(ex)
    if rule is not None:
        rule(ex)


def first_checked(items: Iterable, check_first: Callable[[Any], None]) -> Iterator:
    """`items`, with `check_first` called on the first before it is handed on."""
    items = iter(items)
    for item in items:
        check_first(item)
        yield item
        break
    yield from items
