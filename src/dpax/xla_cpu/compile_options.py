"""XLA compile options chosen per step, by timing the step itself.

XLA:CPU emits each fusion with its newer MLIR "fusion emitters" by default.
For some windowed reductions (the select-and-scatter of an overlapping max
pool's gradient, such a pool in evaluation) the older emitters are faster; for
others (average pools) they are slower; both give the same bits. Where the
default program writes large constant arrays for YNNPACK (a ReLU before an
average pool or a global mean), handing YNNPACK only the dots can be faster
(`YNN_DOTS_ONLY`; the sums then run on another kernel and can round
differently in the last bits), or slower. No op's name tells which, so such
a step is compiled with XLA's defaults and with each candidate at its first
call and each is timed on copies of its arguments, taking turns; a candidate
trains only if it is clearly the fastest, otherwise XLA's defaults stand
(docs/speed.md, "The XLA:CPU tuning, opt-in"). Any other step keeps
XLA's defaults untimed. A training step's 2x2-style pools
(windows that do not overlap) are rewritten without windowed ops by
`dpax.xla_cpu.backward`, so it keeps them too. Several processes take the
old emitters without timing: each would time its own and could choose
otherwise. A timed choice is kept per machine (`dpax.xla_cpu.choices`): a
later process that compiles the same program reads it and times nothing,
so a resumed run takes the options the run it resumes took.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, subjaxprs

from dpax.ratios import Ratio, paired_ratio
from dpax.xla_cpu import choices

WINDOWED = frozenset({
    "reduce_window", "reduce_window_max", "reduce_window_min", "reduce_window_sum",
    "select_and_scatter", "select_and_scatter_add", "select_and_gather_add",
})
OLD_FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": False}
# YNNPACK for dots only. By default XLA:CPU also hands YNNPACK fusions of
# elementwise ops and reductions (a ReLU and the average pool or the global
# mean after it), and YNNPACK takes their broadcast constants as whole arrays:
# the compiled step writes a constant array the size of the activations every
# step, memory traffic that does no arithmetic. Offered where the default
# program writes one of at least `FILL_BYTES`.
YNN_DOTS_ONLY = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
FILL_BYTES = 2**20
# A fusion of one constant that only broadcasts it, in XLA:CPU's optimized HLO.
_FILL = re.compile(r"= (\w+)\[([\d,]*)\]\S* fusion\(%constant[\w.]*\), kind=kLoop, "
                   r"calls=%wrapped_broadcast")


def primitives(jaxpr: Jaxpr | ClosedJaxpr) -> set[str]:
    """Names of every primitive in `jaxpr`, inside shard_map, scan, cond, ... too."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    names = {eqn.primitive.name for eqn in jaxpr.eqns}
    for sub in subjaxprs(jaxpr):
        names |= primitives(sub)
    return names


def for_step(jaxpr: Jaxpr | ClosedJaxpr, hlo: str = "") -> dict[str, dict[str, Any]]:
    """{name: options} worth timing against XLA's defaults for a step traced
    to `jaxpr` and compiled by default to `hlo` (XLA's optimized HLO text;
    {}: none, the defaults stand untimed)."""
    candidates = {}
    if primitives(jaxpr) & WINDOWED:
        candidates["older emitters"] = dict(OLD_FUSION_EMITTERS)
    if largest_fill(hlo) >= FILL_BYTES:
        candidates["YNNPACK dots only"] = dict(YNN_DOTS_ONLY)
    return candidates


def largest_fill(hlo: str) -> int:
    """Bytes of the largest array `hlo` fills with a constant."""
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}
    return max((sizes.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
                for dtype, dims in _FILL.findall(hlo)), default=0)


TIMED_CALLS = 12  # timed rounds before the first look, after the untimed ones
MORE_CALLS = 8  # rounds added while a candidate is neither clearly faster nor slower
MOST_CALLS = 36  # a candidate still undecided then is a tie: XLA's defaults stand
WARMUP_ROUNDS = 2  # a process's first calls run slower (thread pools, fresh pages)
# A candidate trains when the sign test holds it faster than XLA's defaults
# with this confidence (the upper end of the interval for the median of its
# per-round time ratios is below 1), and by at least MARGIN in that median:
# the timing runs the step on copies, apart from the training loop, and a
# hair's gain there is no gain in the loop. A fixed cut on the median of a
# few rounds, the rule before this one, took a tie that noise tipped for a
# gain, and kept that slower choice for good.
CONFIDENCE = 0.9
MARGIN = 0.02
RULE = 2  # part of every kept choice's key: a changed rule times every step again
DIR = "xla_cpu_options"  # the kept choices, under the dpax cache directory


def round_times(compiled: dict[str, Any], args, calls: int = TIMED_CALLS,
                warmup: int = WARMUP_ROUNDS) -> dict[str, list[float]]:
    """{name: seconds of each timed round} of each compiled step on fresh
    copies of `args` (a step donates its state: the run's own arrays are never
    handed over). The steps take turns, in an order that alternates from round
    to round, so that a slow spell of the shared host or a first run's warm-up
    falls on all of them alike; the first `warmup` rounds are not counted.
    (Timing one step's calls and then the other's chose the slower emitters
    for a conv net with average pools in one run of three.)"""
    times: dict[str, list[float]] = {name: [] for name in compiled}
    names = list(compiled)
    for i in range(warmup + calls):
        for name in names if i % 2 else names[::-1]:
            copies = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False)
                                  if isinstance(x, jax.Array) else x, args)
            jax.block_until_ready(copies)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](*copies))
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def ratios(times: dict[str, list[float]]) -> dict[str, Ratio]:
    """Each candidate's time over the defaults' in the same round: their
    median and the sign test's interval for it. Rounds pair the calls that
    ran back to back, so a slow spell that hits one round hits both sides of
    its ratios."""
    return {name: paired_ratio(ts, times["default"], CONFIDENCE)
            for name, ts in times.items() if name != "default"}


def chosen(times: dict[str, list[float]]) -> str:
    """The clearly faster candidate (`CONFIDENCE`, `MARGIN`) with the lowest
    median ratio, else "default"."""
    faster = {name: r.median for name, r in ratios(times).items()
              if r.high < 1 and r.median < 1 - MARGIN}
    return min(faster, key=faster.get, default="default")


def timed_until_decided(compiled: dict[str, Any], args) -> dict[str, list[float]]:
    """`round_times`, then more rounds while a candidate that could still be
    chosen is undecided (its interval holds 1, and no clear winner's median
    is lower), up to `MOST_CALLS`: a clear win or loss is decided in
    `TIMED_CALLS` rounds, a near-tie takes longer."""
    times = round_times(compiled, args)
    while len(times["default"]) < MOST_CALLS and _undecided(times):
        for name, ts in round_times(compiled, args, MORE_CALLS, warmup=0).items():
            times[name] += ts
    return times


def _undecided(times: dict[str, list[float]]) -> bool:
    by_name, best = ratios(times), chosen(times)
    bar = by_name[best].median if best != "default" else 1 - MARGIN
    return any(r.low <= 1 <= r.high and r.median < bar for r in by_name.values())


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
        # "default" and each candidate -> seconds of each timed round, when timed
        self.timed: dict[str, list[float]] = {}
        self._jit = None  # built at the first call outside a trace

    def _chosen(self, args) -> Any:
        if self._jit is None:
            default = self._build({})
            traced = default.trace(*args)
            # Compiled here to be read, and timed below; the jit's first call reuses it.
            lowered = traced.lower()
            compiled = lowered.compile()
            candidates = for_step(traced.jaxpr, compiled.as_text())
            self.options, self._jit = {}, default
            if jax.process_count() > 1:
                # Untimed: each process would time its own and could choose otherwise.
                if "older emitters" in candidates:
                    self.options = candidates["older emitters"]
                    self._jit = self._build(self.options)
            elif candidates:
                jits = {name: self._build(o) for name, o in candidates.items()}
                best = self._kept_or_timed(lowered, candidates, jits, compiled, args)
                if best != "default":
                    self.options, self._jit = candidates[best], jits[best]
        return self._jit

    def _kept_or_timed(self, lowered, candidates: dict, jits: dict, compiled, args) -> str:
        """The choice kept on this machine for this program and candidates
        (`dpax.xla_cpu.choices`), else the timed one, kept for the next
        process: YNNPACK's kernels can round sums otherwise than XLA's
        defaults, so a resumed run must take the choice the run it resumes
        took, not one its own timing's noise picks."""
        key = choices.key_of(RULE, choices.machine(), lowered.as_text(), candidates)
        names = ("default", *candidates)
        kept = choices.read(DIR, key, "chosen")
        if kept in names:
            return kept
        self.timed = timed_until_decided({"default": compiled, **_compiled(jits, args)}, args)
        best = chosen(self.timed)
        kept = choices.write_once(DIR, key, "chosen", best,
                                  {"candidates": candidates, "timed": self.timed})
        return kept if kept in names else best  # a broken file kept first: this timing

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


def _compiled(jits: dict[str, Any], args) -> dict[str, Any]:
    """Each candidate's jit compiled for `args`; one whose options this XLA
    does not take (an experimental option renamed) is left out: a speed-up
    must never block training."""
    out = {}
    for name, jit in jits.items():
        try:
            out[name] = jit.lower(*args).compile()
        except Exception:  # noqa: BLE001
            continue
    return out


def _traced(args) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
