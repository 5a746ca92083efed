"""The bench's order of turns (`dpax.bench.timing.turns`) against the balance
it promises, counted."""

import collections

import pytest

from dpax.bench.timing import Method, time_interleaved, turns


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
