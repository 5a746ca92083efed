"""Every transformation of tests/test_optax_layouts.py under every sharded
layout at N = 3, 5, 8: the largest |param difference| from one replicated
device after 15 steps of an uneven batch (61), as a Markdown table.

    python scripts/optax_table.py [--seeds 0,1,2]

The tests assert a subset of these cells; this prints all of them.
"""

from __future__ import annotations

import argparse
import os
import sys

import dpax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--devices", default="3,5,8")
    args = parser.parse_args()
    dpax.simulate_devices(8)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import conftest  # noqa: F401  (the tests' XLA cache and helpers)
    from test_optax_layouts import TRANSFORMS, max_diff, params_after

    counts = [int(n) for n in args.devices.split(",")]
    cols = [(layout, n) for layout in ("optimizer", "full") for n in counts]
    print("| transformation | " + " | ".join(f"{lay} x{n}" for lay, n in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    seeds = [int(s) for s in args.seeds.split(",")]
    for name in TRANSFORMS:
        one = {seed: params_after(name, 1, seed=seed) for seed in seeds}
        cells = [f"{max(max_diff(params_after(name, n, layout, s), one[s]) for s in seeds):.1e}"
                 for layout, n in cols]
        print(f"| `{name}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
