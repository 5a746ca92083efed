"""The bench's order of turns (`dpax.bench.timing.turns`) against the balance
it promises, counted; its paired ratios (`dpax.ratios.paired_ratio`) against the sign
test's closed form and against the coverage they promise, sampled."""

import collections
import time

import numpy as np
import pytest

from dpax.bench.timing import Method, repeat_steps, time_interleaved, turns
from dpax.ratios import paired_ratio


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7])
def test_turns_balance_position_and_predecessor(n):
    rounds = n if n % 2 == 0 else 2 * n
    order = turns(n, rounds)
    assert all(sorted(row) == list(range(n)) for row in order)
    # Every method at every position equally often.
    positions = collections.Counter((pos, m) for row in order for pos, m in enumerate(row))
    assert set(positions.values()) == {rounds // n}
    # Every ordered pair of different methods adjacent equally often.
    follows = collections.Counter((a, b) for row in order for a, b in zip(row, row[1:]))
    if n > 1:
        assert len(follows) == n * (n - 1)
        assert set(follows.values()) == {rounds // n}


def test_turns_repeat_the_design_for_more_repeats():
    assert turns(4, 9) == turns(4, 4) * 2 + turns(4, 1)
    assert turns(4, 1) == [[0, 1, 3, 2]]


def test_time_interleaved_runs_in_turns():
    ran = []
    methods = [Method(name, 0.0, lambda k, name=name: ran.append((name, k)))
               for name in "abc"]
    rates = time_interleaved(methods, steps=3, repeats=6)
    warm, timed = ran[:3], ran[3:]
    assert warm == [("a", 3), ("b", 3), ("c", 3)]
    assert [name for name, _ in timed] == ["abc"[i] for row in turns(3, 6) for i in row]
    assert {k: len(v) for k, v in rates.items()} == {"a": 6, "b": 6, "c": 6}


def test_a_repeat_lasts_the_minimum_in_whole_doublings_of_the_steps():
    ran = []

    def method(name, seconds_per_step):
        def run(k):
            ran.append((name, k))
            time.sleep(k * seconds_per_step)
        return Method(name, 0.0, run)

    methods = [method("slow", 0.02), method("fast", 0.01)]
    # The fast method's 4 steps last ~40 ms: 8x that reaches 0.3 s (16x would
    # be needed only if its run took over 75 ms).
    assert repeat_steps(methods, 4, min_seconds=0.3) == 32
    assert ran == [("slow", 4), ("fast", 4)]  # each ran once: the warm-up
    assert repeat_steps(methods, 4) == 4  # no minimum: as given
    assert repeat_steps(methods, 4, min_seconds=0.03) == 4  # already long enough


@pytest.mark.parametrize("n,k,coverage", [
    (4, 1, 1 - 2 / 16),  # too few repeats for 90%: [min, max]
    (5, 1, 1 - 2 / 32),
    (7, 1, 1 - 2 / 128),  # k = 2 would hold only 1 - 2 * 8/128 = 0.875
    (9, 2, 1 - 2 * 10 / 512),
    (11, 3, 1 - 2 * 67 / 2048)])
def test_paired_ratio_takes_the_sign_tests_order_statistics(n, k, coverage):
    b = [10.0 + i for i in range(n)]
    ratios = list(0.9 + 0.01 * np.random.default_rng(n).permutation(n))  # distinct, shuffled
    assert len(set(ratios)) == n
    r = paired_ratio([x * y for x, y in zip(ratios, b)], b)
    s = sorted(ratios)
    assert r.median == pytest.approx((s[(n - 1) // 2] + s[n // 2]) / 2)
    assert (r.low, r.high) == (pytest.approx(s[k - 1]), pytest.approx(s[n - k]))
    assert r.coverage == pytest.approx(coverage)


def test_paired_ratio_covers_the_median_as_often_as_it_says():
    """Ratios from a skewed distribution of known median (a slow tail: a turn
    the host interrupted), under a load that moves from turn to turn: the
    interval holds that median at least as often as its coverage promises."""
    rng = np.random.default_rng(0)
    for n in (5, 7, 11):
        held, trials = 0, 4000
        for _ in range(trials):
            hand = rng.uniform(50, 100, n)  # each turn's load
            # exp(-(E - s ln 2)) with E exponential of scale s has median 1.
            ratio = 0.95 * np.exp(-(rng.exponential(0.05, n) - 0.05 * np.log(2)))
            r = paired_ratio(list(hand * ratio), list(hand))
            held += r.low <= 0.95 <= r.high
        assert held / trials >= r.coverage - 0.015, (n, held / trials, r.coverage)
