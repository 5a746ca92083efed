"""XLA compile options chosen per step, by timing the step itself.

XLA:CPU emits each fusion with its newer MLIR "fusion emitters" by default.
For some windowed reductions (the select-and-scatter of an overlapping max
pool's gradient, such a pool in evaluation) the older emitters are faster; for
others (average pools) they are slower; both give the same bits. No op's name
tells which, so a step that holds a windowed op is compiled both ways at its
first call and each is timed on copies of its arguments, the two taking
turns; the candidate trains only if it is clearly the faster, otherwise
XLA's defaults stand (measurements: benchmarks/README.md, "XLA:CPU
options" and "The emitters' choice, timed in turns"). A step
without one keeps XLA's defaults untimed. A training step's 2x2-style pools
(windows that do not overlap) are rewritten without windowed ops by
`dpax.xla_cpu.backward`, so it keeps them too. Several processes take the
old emitters without timing: each would time its own and could choose
otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, subjaxprs

WINDOWED = frozenset({
    "reduce_window", "reduce_window_max", "reduce_window_min", "reduce_window_sum",
    "select_and_scatter", "select_and_scatter_add", "select_and_gather_add",
})
OLD_FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": False}


def primitives(jaxpr: Jaxpr | ClosedJaxpr) -> set[str]:
    """Names of every primitive in `jaxpr`, inside shard_map, scan, cond, ... too."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    names = {eqn.primitive.name for eqn in jaxpr.eqns}
    for sub in subjaxprs(jaxpr):
        names |= primitives(sub)
    return names


def for_step(jaxpr: Jaxpr | ClosedJaxpr) -> dict[str, Any]:
    """The options worth timing against XLA's defaults for a step traced to
    `jaxpr` ({}: none, the defaults stand)."""
    if primitives(jaxpr) & WINDOWED:
        return dict(OLD_FUSION_EMITTERS)
    return {}


TIMED_CALLS = 5  # per candidate, after the untimed rounds; the fastest counts
WARMUP_ROUNDS = 2  # a process's first calls run slower (thread pools, fresh pages)
# The candidate must beat XLA's defaults by this share to be chosen: both give
# the same bits, and a tie goes to the defaults. Measured here, the real wins
# (overlapping max pools) timed 16-25% faster, while steps where the two tie
# in the training loop (average pools, a 2x2 max pool in evaluation) timed up
# to 6.5% apart either way from run to run.
MARGIN = 0.10


def fastest(compiled: dict[str, Any], args, calls: int = TIMED_CALLS) -> dict[str, float]:
    """{name: the fastest of `calls` calls} of each compiled step on fresh
    copies of `args` (a step donates its state: the run's own arrays are never
    handed over). The steps take turns, in an order that alternates from round
    to round, so that a slow spell of the shared host or a first run's
    warm-up falls on all of them alike; the first `WARMUP_ROUNDS` rounds are
    not counted. (Timing one step's calls and then the other's chose the slower
    emitters for a conv net with average pools in one run of three.)"""
    best = dict.fromkeys(compiled, float("inf"))
    names = list(compiled)
    for i in range(WARMUP_ROUNDS + calls):
        for name in names if i % 2 else names[::-1]:
            copies = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False)
                                  if isinstance(x, jax.Array) else x, args)
            jax.block_until_ready(copies)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](*copies))
            if i >= WARMUP_ROUNDS:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def clearly_faster(timed: dict[str, float]) -> bool:
    """Whether the candidate beat the defaults by more than `MARGIN`."""
    return timed["candidate"] < (1 - MARGIN) * timed["default"]


class ChosenJit:
    """A jitted step whose compile options are chosen at its first call, from
    its trace; later calls go straight to the chosen `jax.jit`.

    `build(options)` returns the `jax.jit` for a dict of options, chosen by
    `for_step`. The choosing trace lands in jit's trace cache, which the
    chosen jit shares, so nothing is traced twice.
    """

    def __init__(self, build: Callable[[dict], Any]):
        self._build = build
        self.options: dict[str, Any] | None = None  # chosen at the first call
        self.timed: dict[str, float] = {}  # "default"/"candidate" -> seconds, when timed
        self._jit = None  # built at the first call outside a trace

    def _chosen(self, args) -> Any:
        if self._jit is None:
            default = self._build({})
            candidate = for_step(default.trace(*args).jaxpr)
            self.options, self._jit = {}, default
            if candidate and jax.process_count() > 1:
                self.options, self._jit = candidate, self._build(candidate)
            elif candidate:
                other = self._build(candidate)
                self.timed = fastest({name: jit.lower(*args).compile() for name, jit
                                      in (("default", default), ("candidate", other))}, args)
                if clearly_faster(self.timed):
                    self.options, self._jit = candidate, other
        return self._jit

    def __call__(self, *args):  # the training loop's hot path: one check once chosen
        jit = self._jit
        if jit is None:
            if _traced(args):
                # Inside another trace (`jax.eval_shape`): a nested jit takes no
                # options, and nothing is compiled there to choose them for.
                return self._build({})(*args)
            jit = self._chosen(args)
        return jit(*args)

    def lower(self, *args):
        return self._chosen(args).lower(*args)


def _traced(args) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
