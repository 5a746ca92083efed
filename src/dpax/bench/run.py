"""The bench's config and its run: every method of every workload, timed in
turns (`timing`) against the hand-written loops (`baselines`), written as
tables and plots (`report`)."""

from __future__ import annotations

import dataclasses
import os
import statistics

import jax

from dpax import config as cfg
from dpax.bench.baselines import bench_dpax, bench_jit, bench_pmap_loop
from dpax.bench.report import format_row, write_results
from dpax.bench.timing import repeat_steps, time_interleaved
from dpax.bench.workloads import OPTIMIZERS, WORKLOADS
from dpax.errors import DpaxError
from dpax.parallel import peak as peaks
from dpax.parallel.layout import check_sharding
from dpax.ratios import paired_ratio

# A timed repeat lasts at least this long unless `--steps` is given (`repeat_steps`).
MIN_REPEAT_S = 0.2


@dataclasses.dataclass
class BenchConfig:
    """`dpax bench`: dpax against hand-written pmap and jit loops."""

    workloads: str = cfg.field("tiny,mlp,cnn,digits,gpt",
                               "comma-separated: tiny, mlp, cnn, digits, gpt, and conv nets "
                               "that downsample otherwise: cnn-avg, cnn-max3, cnn-strided, "
                               "cnn-gap; gpt-wide: 12 x 768 on 16 tokens, a step the "
                               "optimizer bounds")
    optimizer: str = cfg.field("adam", "what every method trains with: sgd, momentum, adam, "
                               "adamw")
    devices: str = cfg.field("1,2,4,8", "device counts, comma-separated", metavar="N,N")
    repeats: int = cfg.field(5, "timed repeats")
    steps: int | None = cfg.field(None, "steps per repeat (default: the workload's, doubled "
                                      "until a repeat lasts 0.2 s)")
    steps_per_call: int = cfg.field(8, "K for the dpax/k=K row (1 leaves it out)")
    sweep: bool = cfg.field(True, "also the examples/s vs batch size sweep")
    sharding: str = cfg.field("replicated", "comma-separated state layouts to time on "
                              "shard_map: replicated, optimizer, full (one dpax/<layout> row "
                              "each)")
    out: str = cfg.field("benchmarks/results", "where results.md, results.json and PNGs go",
                         metavar="DIR")

    def names(self) -> list[str]:
        return [w for w in self.workloads.split(",") if w]

    def layouts(self) -> list[str]:
        return [m for m in self.sharding.split(",") if m]

    def counts(self) -> list[int]:
        try:
            return [int(n) for n in self.devices.split(",")]
        except ValueError:
            raise DpaxError(f"`devices` must be comma-separated counts, got "
                            f"{self.devices!r}") from None

    def check(self) -> None:
        unknown = [w for w in self.names() if w not in WORKLOADS]
        if unknown or not self.names():
            raise DpaxError(f"unknown workload(s) {', '.join(unknown) or '(none)'}; choose "
                            f"from {', '.join(WORKLOADS)}")
        if any(n < 1 for n in self.counts()):
            raise DpaxError(f"`devices` must be counts >= 1, got {self.devices!r}")
        check_counts(self.names(), self.counts())
        cfg.one_of(self, "optimizer", OPTIMIZERS)
        for name in ("repeats", "steps", "steps_per_call"):
            cfg.whole(self, name)
        for mode in self.layouts():
            check_sharding(mode, "shard_map")


def check_counts(workloads, device_counts) -> None:
    """Refuse a device count that splits no workload's batch: it would time nothing."""
    batches = {name: WORKLOADS[name].batch_size for name in workloads}
    for n in device_counts:
        if all(b % n for b in batches.values()):
            sizes = ", ".join(f"{name} {b}" for name, b in batches.items())
            raise DpaxError(f"`devices` {n} divides no workload's batch ({sizes}); use "
                            "counts that divide them, e.g. 1,2,4,8")


def run_bench(workloads, device_counts, repeats=5, steps=None, steps_per_call=8,
              sweep=True, out_dir="benchmarks/results", shardings=(), log=print,
              optimizer="adam") -> list[dict]:
    """Measure everything, every method training with `optimizer` (a name in
    `OPTIMIZERS`); write results.md, results.json and PNGs to `out_dir`.

    Raises:
      DpaxError: a device count that splits no workload's batch, an `out_dir`
        that is a file."""
    check_counts(workloads, device_counts)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # the CLI's --out too
        raise DpaxError(f"`out={out_dir}` is a file; give a directory for the results")
    os.makedirs(out_dir, exist_ok=True)
    # One device's peak (the kept best measurement on CPU, `dpax.parallel.peak`).
    peak = peaks.for_devices(jax.devices()[:1])
    rows = []
    for name in workloads:
        w = dataclasses.replace(WORKLOADS[name], optimizer=optimizer)
        s = steps or w.steps
        jit = bench_jit(w, w.batch_size)
        for n in device_counts:
            if w.batch_size % n:
                log(f"{name} skipped on {n} devices: its batch of {w.batch_size} does not "
                    "split evenly")
                continue
            methods = [bench_pmap_loop(w, n, w.batch_size), jit]
            if n > 1:
                methods.append(bench_jit(w, w.batch_size, n))
            # On one device as `jit 1 device` runs: a one-device mesh would add a put per step.
            methods.append(bench_jit(w, w.batch_size, n if n > 1 else None, masked=True))
            methods += [bench_dpax(w, n, backend, w.batch_size)
                        for backend in ("shard_map", "pmap")]
            if jax.default_backend() == "cpu":  # the opt-in XLA:CPU tuning
                methods.append(bench_dpax(w, n, "shard_map", w.batch_size,
                                          name="dpax/tuned", xla_cpu_tuning=True))
            # The opt-in non-finite guard: its price is its distance to the
            # default row, which does a hand loop's work.
            methods.append(bench_dpax(w, n, "shard_map", w.batch_size, name="dpax/guard",
                                      skip_nonfinite=True))
            if steps_per_call > 1:
                methods.append(bench_dpax(w, n, "shard_map", w.batch_size, steps_per_call,
                                          f"dpax/k={steps_per_call}"))
            methods += [bench_dpax(w, n, "shard_map", w.batch_size, name=f"dpax/{mode}",
                                   sharding=mode) for mode in shardings if mode != "replicated"]
            # `--steps` is taken as given; a workload's own are a floor.
            per_repeat = repeat_steps(methods, s, 0.0 if steps else MIN_REPEAT_S)
            rates = time_interleaved(methods, per_repeat, repeats, warm_up=False)
            loop_med = statistics.median(rates["pmap loop"])
            # The best loop a user writes by hand: pmap, or jit (sharded when N > 1).
            hand = max(("pmap loop", "jit sharded" if n > 1 else "jit 1 device"),
                       key=lambda m: statistics.median(rates[m]))
            for m in methods:
                med = statistics.median(rates[m.name])
                vs_hand = paired_ratio(rates[m.name], rates[hand])
                row = {"workload": name, "devices": n, "method": m.name,
                       "compile_s": m.compile_s, "steps_per_sec": med, "min": min(rates[m.name]),
                       "vs_pmap_loop": med / loop_med, "vs_best_hand": vs_hand.median,
                       "vs_best_hand_interval": [vs_hand.low, vs_hand.high],
                       "interval_coverage": vs_hand.coverage,
                       "memory_mib": m.memory / 2**20,
                       "state_mib": m.state / 2**20,
                       "batch_size": w.batch_size, "optimizer": optimizer,
                       "steps_per_repeat": per_repeat}
                if m.comms is not None:
                    row["collectives"] = m.comms
                if w.flops_per_example:
                    row["flops"] = w.flops_per_example * w.batch_size * med
                    peak.observe(row["flops"])
                    row["flops_frac"] = row["flops"] / peak.flops  # final below
                rows.append(row)
                log(format_row(row))
    sweep_rows = _batch_sweep(repeats, steps, optimizer) if sweep else []
    for row in rows:  # against the final peak: a row faster than the measured one raised it
        if "flops" in row:
            row["flops_frac"] = row.pop("flops") / peak.flops
    write_results(rows, sweep_rows, peak.flops, out_dir, optimizer)
    return rows


def _batch_sweep(repeats, steps, optimizer, n=8):
    rows = []
    for name in ("mlp", "cnn"):
        w = dataclasses.replace(WORKLOADS[name], optimizer=optimizer)
        s = max(5, (steps or w.steps) // 2)
        for b in (64, 128, 256, 512, 1024):
            rates = time_interleaved([bench_pmap_loop(w, n, b),
                                      bench_dpax(w, n, "shard_map", b)], s, repeats)
            for method, r in rates.items():
                rows.append({"workload": name, "batch_size": b, "method": method,
                             "examples_per_sec": b * statistics.median(r)})
    return rows


