"""The benchmark's outputs: results.md, results.json and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import time

import jax
import numpy as np

INTERVAL = ("\"vs best hand loop\": the median of the ratios of each repeat (both ran in "
            "the same turn), and in brackets the sign test's interval for the median of "
            "such ratios: it holds it with probability >= 90% "
            "(`dpax.ratios.paired_ratio`; [min, max] below 5 repeats).")


def format_row(r: dict) -> str:
    flops = f" {100 * r['flops_frac']:5.1f}%" if "flops_frac" in r else "     -"
    mem, state = ("-" if np.isnan(r.get(k, np.nan)) else f"{r[k]:.1f}"
                  for k in ("memory_mib", "state_mib"))
    vs_hand = f"{r['vs_best_hand']:.2f}x"
    if "vs_best_hand_interval" in r:
        vs_hand += " [{:.2f}, {:.2f}]".format(*r["vs_best_hand_interval"])
    return (f"| {r['workload']} | {r['devices']} | {r['method']} | {r['compile_s']:.2f} | "
            f"{r['steps_per_sec']:.1f} | {r['min']:.1f} | {r['vs_pmap_loop']:.2f}x | "
            f"{vs_hand} | {mem} | "
            f"{state} |{flops} |")


def write_results(rows, sweep_rows, peak, out_dir, optimizer):
    header = ("| workload | N | method | compile s | steps/s median | steps/s min | "
              "vs pmap loop | vs best hand loop | step MiB/device | state MiB/device | "
              "FLOP/s of peak |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    tunables = os.environ.get("GLIBC_TUNABLES") or "none"  # malloc settings move XLA:CPU
    text = [f"dpax bench, {time.strftime('%Y-%m-%d')}, {machine}, jax {jax.__version__}, "
            f"{jax.default_backend()}; matmul peak {peak / 1e9:.1f} GFLOP/s (f32, one device); "
            f"GLIBC_TUNABLES {tunables}; every method trains with {optimizer}",
            "", INTERVAL, "", "Steps per timed repeat (each dpax repeat is one `fit` call): "
            + _steps_per_repeat(rows), "", header] + [format_row(r) for r in rows]
    text += comms_table(rows)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"rows": rows, "sweep": sweep_rows, "matmul_peak": peak,
                   "optimizer": optimizer}, f, indent=1)
    _plots(rows, sweep_rows, out_dir)


def _steps_per_repeat(rows) -> str:
    seen = {(r["workload"], r["devices"]): r.get("steps_per_repeat") for r in rows}
    return ", ".join(f"{w} N={n}: {s}" for (w, n), s in seen.items() if s) or "-"


def comms_table(rows) -> list[str]:
    """Each dpax row's collectives per step (from its compiled HLO) against the
    least its layout needs (`dpax.parallel.comms`)."""
    lines = ["", "Collectives per step, from the compiled step's HLO (logical bytes: what "
             "each reduces or gathers), against the least the layout needs:", "",
             "| workload | N | method | collectives (count, MiB) | MiB | least MiB | "
             "MiB / least |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r.get("collectives")
        if not c or not c["minimum"]:
            continue
        found = ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f}"
                          for k, v in sorted(c["found"].items()))
        total = sum(v["bytes"] for v in c["found"].values()) / 2**20
        least = sum(c["minimum"].values()) / 2**20
        lines.append(f"| {r['workload']} | {r['devices']} | {r['method']} | {found or '-'} | "
                     f"{total:.2f} | {least:.2f} | {total / least:.3f} |")
    return lines


def _plots(rows, sweep_rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False,
                             constrained_layout=True)
    for ax, name in zip(axes[0], names):
        for method in sorted({r["method"] for r in rows}):
            pts = sorted((r["devices"], r["steps_per_sec"]) for r in rows
                         if r["workload"] == name and r["method"] == method)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set(title=name, xlabel="devices", ylabel="steps/s", xscale="log", xticks=[1, 2, 4, 8])
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.minorticks_off()  # log-axis minor labels ("3x10^0") only clutter
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.savefig(os.path.join(out_dir, "steps_per_sec_vs_devices.png"), dpi=100)
    plt.close(fig)
    if not sweep_rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), constrained_layout=True)
    for ax, name in zip(axes, ("mlp", "cnn")):
        for method in ("pmap loop", "dpax/shard_map"):
            pts = [(r["batch_size"], r["examples_per_sec"]) for r in sweep_rows
                   if r["workload"] == name and r["method"] == method]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set(title=f"{name}, 8 devices", xlabel="global batch", ylabel="examples/s",
               xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(os.path.join(out_dir, "examples_per_sec_vs_batch.png"), dpi=100)
    plt.close(fig)
