"""`dpax bench`: dpax against the hand-written loops the seeds teach, measured
in one process on the same devices (`baselines`), in turns (`timing`), written
as tables and plots (`report`)."""

from __future__ import annotations

import dataclasses
import os
import statistics

from dpax.bench.baselines import bench_dpax, bench_jit, bench_pmap_loop
from dpax.bench.report import _fmt_row, _write
from dpax.bench.timing import matmul_peak, time_interleaved
from dpax.bench.workloads import OPTIMIZERS, WORKLOADS

__all__ = ["OPTIMIZERS", "WORKLOADS", "run_bench"]


def run_bench(workloads, device_counts, repeats=5, steps=None, steps_per_call=8,
              sweep=True, out_dir="benchmarks/results", shardings=(), log=print,
              optimizer="adam") -> list[dict]:
    """Measure everything, every method training with `optimizer` (a name in
    `OPTIMIZERS`); write results.md, results.json and PNGs to `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    peak = matmul_peak()
    rows = []
    for name in workloads:
        w = dataclasses.replace(WORKLOADS[name], optimizer=optimizer)
        s = steps or w.steps
        jit = bench_jit(w, w.batch_size)
        for n in device_counts:
            if w.batch_size % n:
                continue
            methods = [bench_pmap_loop(w, n, w.batch_size), jit]
            if n > 1:
                methods.append(bench_jit(w, w.batch_size, n))
            methods += [bench_dpax(w, n, backend, w.batch_size)
                        for backend in ("shard_map", "pmap")]
            if steps_per_call > 1:
                methods.append(bench_dpax(w, n, "shard_map", w.batch_size, steps_per_call,
                                          f"dpax/k={steps_per_call}"))
            methods += [bench_dpax(w, n, "shard_map", w.batch_size, name=f"dpax/{mode}",
                                   sharding=mode) for mode in shardings if mode != "replicated"]
            rates = time_interleaved(methods, s, repeats)
            loop_med = statistics.median(rates["pmap loop"])
            for m in methods:
                med = statistics.median(rates[m.name])
                row = {"workload": name, "devices": n, "method": m.name,
                       "compile_s": m.compile_s, "steps_per_sec": med, "min": min(rates[m.name]),
                       "vs_pmap_loop": med / loop_med, "memory_mib": m.memory / 2**20,
                       "state_mib": m.state / 2**20,
                       "batch_size": w.batch_size, "optimizer": optimizer}
                if w.flops_per_example:
                    row["flops_frac"] = w.flops_per_example * w.batch_size * med / peak
                rows.append(row)
                log(_fmt_row(row))
    sweep_rows = _batch_sweep(repeats, steps, optimizer) if sweep else []
    _write(rows, sweep_rows, peak, out_dir, optimizer)
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


