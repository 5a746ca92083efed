"""An error of the user's own code (the loss, the model) on a batch, said in
one line with the user's line: the training step's first trace runs that
code on the examples' shapes, so a model made for other features, or a loss
that reads a key the examples do not hold, fails there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np

from dpax.analysis.propagate import user_line
from dpax.data.batches import MASK
from dpax.errors import DpaxError, FailsOnExamples

# JAX's errors about the code it traces (a Python `if` on a traced value, a
# leaked tracer): the examples are not their cause, and JAX's own message,
# with its explanation, says more than one line could.
_TRACING = (jax.errors.JAXTypeError, jax.errors.JAXIndexError)


@contextlib.contextmanager
def on_examples(batch: dict, code: str = "the loss or the model",
                added: str = "mask and index") -> Iterator[None]:
    """Raise an error of the user's code inside (`code` names it) as
    `FailsOnExamples`, which names the examples' arrays (one example's shape
    and dtype) and the line. `batch`: a host batch as the step takes it,
    before dpax adds its `added` keys. Errors at run time, not the trace's,
    come from no line of the user's and pass as they are."""
    try:
        yield
    except (DpaxError, *_TRACING):
        raise
    except Exception as error:
        where = user_line(error)
        if where is None:
            raise
        held = ", ".join(f"{k} {_example(v)}" for k, v in batch.items() if k != MASK)
        if isinstance(error, KeyError):
            found = (f"looks up {error.args[0]!r}, a key the examples do not hold (they hold "
                     f"{held}; dpax adds {added}), at {where}: give the examples that key, "
                     "or read one they hold")
        else:
            text = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else ""
            found = (f"fails on a batch of the examples ({held}) with {type(error).__name__}: "
                     f"{text}, at {where}: fix that line or the examples")
        raise FailsOnExamples(f"{code} {found}", where) from error


def _example(array) -> str:
    a = np.asarray(array) if not hasattr(array, "shape") else array
    return f"{tuple(a.shape[1:])} {np.dtype(a.dtype).name}"
