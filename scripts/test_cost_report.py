"""Where a test session's time went, per test file (and the slowest tests):
wall seconds against the seconds JAX spent compiling, tracing and lowering.

    DPAX_TEST_COST_DIR=/tmp/costs make test
    python scripts/test_cost_report.py /tmp/costs [--tests 20]

The files come from tests/cost_report.py, one per pytest process; the two
tiers of `make test` write to the same directory and add up here.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os

COLUMNS = ("wall", "compile", "compiles", "trace", "lower", "cache_saved")


def load(directory: str) -> dict[str, collections.Counter]:
    per_test: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            for nodeid, seconds in json.load(f).items():
                per_test[nodeid].update(seconds)
    return per_test


def table(rows: dict[str, collections.Counter], name: str) -> str:
    lines = [f"| {name} | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for key, c in sorted(rows.items(), key=lambda kv: -kv[1]["wall"]):
        lines.append(f"| {key} | " + " | ".join(
            f"{int(c[col])}" if col == "compiles" else f"{c[col]:.1f}" for col in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--tests", type=int, default=15, help="the slowest tests to list")
    args = parser.parse_args(argv)
    per_test = load(args.directory)
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for nodeid, c in per_test.items():
        per_file[nodeid.split("::")[0]].update(c)
    total = sum(per_file.values(), collections.Counter())
    wall = max(total["wall"], 1e-9)
    print(f"{len(per_test)} tests, {total['wall']:.0f} s summed over the pytest processes: "
          f"XLA compile {total['compile']:.0f} s ({total['compile'] / wall:.0%}, "
          f"{int(total['compiles'])} compilations), tracing {total['trace']:.0f} s and lowering "
          f"{total['lower']:.0f} s ({(total['trace'] + total['lower']) / wall:.0%}); the "
          f"persistent cache saved {total['cache_saved']:.0f} s.\n")
    print(table(per_file, "file"))
    slowest = dict(sorted(per_test.items(), key=lambda kv: -kv[1]["wall"])[:args.tests])
    print()
    print(table(slowest, "test"))


if __name__ == "__main__":
    main()
