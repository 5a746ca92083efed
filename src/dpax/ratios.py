"""Paired speed ratios: how much faster one method ran than another, from
rates of the same repeats, with an interval that holds whatever the noise.

The bench (`dpax.bench.run`) and the XLA:CPU tuning's timed choices
(`dpax.xla_cpu.compile_options`) both decide by it; it is plain statistics
(the standard library only), so it sits below both.
"""

from __future__ import annotations

import dataclasses
import math
import statistics


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A method's speed over another's, paired by repeat: `median` of the
    per-repeat ratios, and `low`..`high`, an interval that holds the true
    median with probability >= `coverage` whatever the noise's distribution."""

    median: float
    low: float
    high: float
    coverage: float

    def __str__(self) -> str:
        return f"{self.median:.2f}x [{self.low:.2f}, {self.high:.2f}]"


def paired_ratio(a: list[float], b: list[float], least_coverage: float = 0.9) -> Ratio:
    """`a` over `b`, rates of the same repeats (`dpax.bench.timing.time_interleaved`,
    or any methods timed in turns). Each
    repeat's ratio is taken first: both ran in the same turn, so a change in
    the host's load between repeats cancels out of it, where a ratio of two
    medians keeps it.
    The interval is the sign test's: the k-th smallest and k-th largest
    ratio, with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k),
    is still >= `least_coverage` (k = 1, all of them, when none is: n < 5)."""
    if len(a) != len(b) or not a:
        raise ValueError("paired_ratio needs rates of the same repeats")
    r = sorted(x / y for x, y in zip(a, b))
    n = len(r)

    def coverage(k):  # P(the true median lies in [r[k-1], r[n-k]])
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < (n + 1) // 2 and coverage(k + 1) >= least_coverage:
        k += 1
    return Ratio(statistics.median(r), r[k - 1], r[n - k], coverage(k))
