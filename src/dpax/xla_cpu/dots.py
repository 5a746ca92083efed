"""Which form of a weight gradient's dot XLA:CPU runs faster, timed on its shapes.

JAX differentiates a dense layer `y = x @ w` on [batch, features] into
`transpose(dot(dy, x))` (attention's batched products alike). XLA folds the
transpose into the dot, which then writes a transposed result: a dot YNNPACK
refuses, so Eigen runs it. Kept apart (`dpax.xla_cpu.backward` puts a
barrier between them), the dot stays a YNNPACK dot and the transpose is a
copy. Which is faster depends on the shapes, not on the op: for a wide
hidden layer the folded dot is the faster, for a narrow classifier head the
kept pair (Eigen's transposed-output kernel is slow on a result a few
columns wide). So each shape is timed both ways, alone, once per machine:

- the kept pair is chosen only when it is at least `MARGIN` times faster, and
  only for a dot whose folded form takes at least `FLOOR_S`, so that noise
  near a tie, or in a call of a few microseconds, leaves XLA's own form;
- a dot too small to take `FLOOR_S` on any CPU (`MIN_MACS`) is not timed
  at all: it stays folded. Timed, such a dot's call is all dispatch, so
  noise alone would choose, and every timing compiles two programs;
- the choice is kept per machine (`dpax.xla_cpu.choices`): the first
  process to decide wins, and every later one (a resumed run, the other
  ranks of a launch on this host) reads that choice instead of timing
  again. The two forms can round the dot's sum differently in the last bit,
  so every process on a machine must take the same one.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from dpax.xla_cpu import choices, compile_options

MARGIN = 1.5  # the kept pair must be this much faster to be chosen
# ... for a dot that contracts several dimensions (batch and tokens), where
# the kept pair is usually the faster and so was the rule before timing.
MARGIN_SEVERAL = 1.05
# A folded dot faster than this stays: so short a call is mostly dispatch,
# its timing noise, and the copy the kept pair adds costs a step one more op.
FLOOR_S = 50e-6
# Multiply-adds under which a dot cannot take FLOOR_S on any CPU: at 0.25
# GMAC/s (scalar code at 1 GHz, a multiply-add every 4 cycles) these take
# under 50 us.
MIN_MACS = 12_500
RULE = 3  # part of every key: a changed rule times every shape again
CALLS = 7  # timed calls per form, in turns (`compile_options.round_times`); the fastest counts
DIR = "xla_cpu_dots"  # under the dpax cache directory

_decided: dict[str, bool] = {}  # this process's choices, by key


def keep_apart(lhs, rhs, params: dict, permutation: tuple[int, ...],
               margin: float = MARGIN) -> bool:
    """Whether `transpose(dot_general(lhs, rhs, **params), permutation)` runs
    faster with the two kept apart than folded into one dot, on this machine,
    by at least `margin` (`lhs`, `rhs`: the operands' avals, or anything with
    a shape and dtype)."""
    if macs(lhs, rhs, params["dimension_numbers"]) < MIN_MACS:
        return False
    spec = {"lhs": [list(lhs.shape), str(lhs.dtype)], "rhs": [list(rhs.shape), str(rhs.dtype)],
            "dims": repr(params["dimension_numbers"]),
            "out": str(params.get("preferred_element_type")), "perm": list(permutation),
            "margin": margin}
    key = key_of(spec)
    if key not in _decided:
        kept = _read(key)
        if kept is None:
            t = seconds(lhs, rhs, params, permutation)
            apart = t["folded"] >= FLOOR_S and t["apart"] * margin <= t["folded"]
            kept = _write_once(key, spec, apart)
        _decided[key] = kept
    return _decided[key]


def macs(lhs, rhs, dimension_numbers) -> int:
    """Multiply-adds of `dot_general(lhs, rhs)`: every output element (batch x
    lhs free x rhs free) sums over the contracted dimensions."""
    (contract, _), (batch, _) = dimension_numbers
    shared = math.prod(lhs.shape[i] for i in (*contract, *batch))
    return math.prod(lhs.shape) * math.prod(rhs.shape) // max(shared, 1)


def key_of(spec: dict) -> str:
    """The file name of a choice: the shapes on this machine and JAX."""
    return choices.key_of(RULE, choices.machine(), spec)


def seconds(lhs, rhs, params, permutation) -> dict[str, float]:
    """The fastest of `CALLS` calls of each form ("folded", "apart") on this
    machine's first CPU device, the two taking turns."""
    dims = params["dimension_numbers"]
    out = params.get("preferred_element_type")

    def folded(a, b):
        return lax.transpose(lax.dot_general(a, b, dims, preferred_element_type=out),
                             permutation)

    def apart(a, b):
        return lax.transpose(lax.optimization_barrier(
            lax.dot_general(a, b, dims, preferred_element_type=out)), permutation)

    rng = np.random.default_rng(0)
    device = jax.local_devices(backend="cpu")[0]
    with jax.ensure_compile_time_eval():  # runs now, also while a step is traced
        args = [jax.device_put(rng.standard_normal(v.shape).astype(v.dtype), device)
                for v in (lhs, rhs)]
        times = compile_options.round_times({name: jax.jit(f).lower(*args).compile()
                                         for name, f in (("folded", folded), ("apart", apart))},
                                        args, CALLS)
        return {name: min(ts) for name, ts in times.items()}


def _read(key: str) -> bool | None:
    kept = choices.read(DIR, key, "apart")
    return None if kept is None else bool(kept)


def _write_once(key: str, spec: dict, apart: bool) -> bool:
    """Keep `apart` for `key` unless a process decided first: then its choice stands."""
    return bool(choices.write_once(DIR, key, "apart", apart, spec))
