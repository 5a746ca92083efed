"""What the non-finite guard costs `Trainer.fit`: dpax with the opt-in
`skip_nonfinite=True` and with the default against the bench's hand loops,
in interleaved turns.

    python scripts/skip_nonfinite_bench.py --workloads gpt-wide,mlp --devices 1

The guard makes every update wait for the whole gradient; where the
optimizer's passes bound the step (`gpt-wide`), XLA:CPU can then no longer
update each leaf while its gradient is in cache. Results: benchmarks/README.md,
"The guard on a large model, and its weight-gradient dots".
"""

from __future__ import annotations

import argparse
import statistics

from dpax.bench import baselines
from dpax.bench.timing import time_interleaved
from dpax.bench.workloads import WORKLOADS
from dpax.parallel.mesh import simulate_devices
from dpax.ratios import paired_ratio


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gpt-wide,mlp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per repeat (default: the workload's; on a GPU use more, "
                        "so that a fit call's fixed cost does not dominate)")
    parser.add_argument("--tuning", choices=("on", "off"), default="on",
                        help="dpax's XLA:CPU tuning (off: the path GPUs and TPUs take)")
    args = parser.parse_args(argv)
    tuning, n = args.tuning == "on", args.devices
    simulate_devices(max(n, 8))  # before JAX starts its backend
    print("Ratios: the median of each repeat's ratio [the sign test's >= 90% interval]")
    print("| workload | N | tuning | dpax, skip_nonfinite=True | dpax | best hand loop | "
          "guard vs hand | dpax vs hand |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        b = w.batch_size
        ms = [baselines.bench_dpax(w, n, "shard_map", b, name="guard", xla_cpu_tuning=tuning,
                                   skip_nonfinite=True),
              baselines.bench_dpax(w, n, "shard_map", b, name="dpax", xla_cpu_tuning=tuning),
              baselines.bench_jit(w, b, n if n > 1 else None), baselines.bench_pmap_loop(w, n, b)]
        steps = args.steps or w.steps
        rates = time_interleaved(ms, steps, args.repeats)
        med = {k: statistics.median(v) for k, v in rates.items()}
        hand = max("jit 1 device" if n == 1 else "jit sharded", "pmap loop", key=med.get)
        on, off = (paired_ratio(rates[m], rates[hand])
                   for m in ("guard", "dpax"))
        print(f"| {name} | {n} | {args.tuning} | {med['guard']:.2f} | "
              f"{med['dpax']:.2f} | {med[hand]:.2f} | {on} | {off} |",
              flush=True)


if __name__ == "__main__":
    main()
