"""XLA compile options chosen per step from what the step computes.

XLA:CPU emits each fusion with its newer MLIR "fusion emitters" by default.
For windowed reductions (max and average pooling, and the select-and-scatter
of max pooling's gradient) the older emitters are faster, and give the same
bits; elsewhere the new ones win. So only a step that pools gets the old ones
(the measurements: benchmarks/README.md, "XLA:CPU options"). A training step's
2x2-style pools (windows that do not overlap) are rewritten without windowed
ops by `dpax.xla_cpu.backward`, so it keeps XLA's defaults; evaluation, and
overlapping or average pools, get the old emitters.
"""

from __future__ import annotations

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
    """The XLA:CPU compile options for a step traced to `jaxpr`."""
    if primitives(jaxpr) & WINDOWED:
        return dict(OLD_FUSION_EMITTERS)
    return {}


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
        self._jit = None  # built at the first call outside a trace

    def _chosen(self, args) -> Any:
        if self._jit is None:
            default = self._build({})
            self.options = for_step(default.trace(*args).jaxpr)
            self._jit = default if not self.options else self._build(self.options)
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
