"""`dpax bench`: dpax against the hand-written loops the seeds teach, measured
in one process on the same devices.

Methods, per workload and device count N:
  dpax/shard_map, dpax/pmap   the real `Trainer.fit` path (host batches, masks, metrics)
  dpax/k=K                    the same with K steps per compiled call
  pmap loop                   seed 000/004's loop: pmap + pmean, batches reshaped on the host
  jit 1 device                a plain jit loop on one device with the whole batch
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpax import losses, models
from dpax.sharding import replicate
from dpax.trainer import Trainer

LR = 0.01


class Dense(nnx.Module):
    """Fully connected ReLU layers of the given sizes (input first)."""

    def __init__(self, sizes: tuple[int, ...], *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    input_shape: tuple[int, ...]
    batch_size: int
    make: Callable[[], nnx.Module]
    flops_per_example: float | None = None  # forward + backward, for FLOP/s


def _dense_flops(sizes):
    return 6.0 * sum(a * b for a, b in zip(sizes, sizes[1:]))  # 2 forward + 4 backward


WORKLOADS = {
    "tiny": Workload("tiny", (16,), 128, lambda: Dense((16, 32, 10), rngs=nnx.Rngs(0))),
    "mlp": Workload("mlp", (784,), 256, lambda: Dense((784, 1024, 1024, 10), rngs=nnx.Rngs(0)),
                    _dense_flops((784, 1024, 1024, 10))),
    "cnn": Workload("cnn", (32, 32, 3), 128, lambda: models.CNN((32, 32, 3), 10,
                                                                rngs=nnx.Rngs(0))),
    "digits": Workload("digits", (8, 8, 1), 128, lambda: models.CNN((8, 8, 1), 10,
                                                                    rngs=nnx.Rngs(0))),
}


def synthetic(w: Workload, batch_size: int, n_batches: int = 8):
    rng = np.random.default_rng(0)
    n = batch_size * n_batches
    x = rng.normal(size=(n,) + w.input_shape).astype(np.float32)
    return x, rng.integers(0, 10, n).astype(np.int32)


@dataclasses.dataclass
class Method:
    """One way to train a workload: `run(k)` trains k steps and waits for them."""

    name: str
    compile_s: float  # the first call: tracing, compiling, placing the state
    run: Callable[[int], None]
    memory: float = float("nan")  # bytes per device the step needs, when known


def time_interleaved(methods: list[Method], steps: int, repeats: int) -> dict[str, list[float]]:
    """Steps/s of `repeats` timed runs of `steps` steps per method, after one
    warm-up run each. The methods take turns within each repeat, so a change
    in the machine's load hits all of them alike (this host is shared)."""
    for m in methods:
        m.run(steps)  # warm-up: thread pools, caches
    rates: dict[str, list[float]] = {m.name: [] for m in methods}
    for _ in range(repeats):
        for m in methods:
            t0 = time.perf_counter()
            m.run(steps)
            rates[m.name].append(steps / (time.perf_counter() - t0))
    return rates


def _first_call(name: str, run: Callable[[int], None], k: int = 1) -> Method:
    t0 = time.perf_counter()
    run(k)
    return Method(name, time.perf_counter() - t0, run)


def bench_dpax(w, n, backend, batch_size, steps_per_call=1, name=None) -> Method:
    x, y = synthetic(w, batch_size)
    t = Trainer(w.make(), losses.classification_loss, optax.sgd(LR), devices=n,
                backend=backend, steps_per_call=steps_per_call)
    done = [0]

    def run(k):  # fit trains until the step counter reaches the total
        done[0] += k
        t.fit(x, y, batch_size=batch_size, steps=done[0], log_every=10**9)

    method = _first_call(name or f"dpax/{backend}", run, steps_per_call)
    method.memory = _step_memory(t, batch_size, w.input_shape)  # after: it compiles too
    return method


def _step_memory(t: Trainer, batch_size: int, input_shape) -> float:
    """Bytes one device needs for the step: arguments + temporaries, from XLA."""
    size = t.padded(batch_size)
    host = {"x": np.zeros((size,) + input_shape, np.float32), "y": np.zeros(size, np.int32),
            "mask": np.ones(size, bool)}
    m = t.lower_train_step(host, size).compile().memory_analysis()
    if m is None:
        return float("nan")
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)


def _mean_loss(graphdef, params, x, y):
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def bench_pmap_loop(w, n, batch_size) -> Method:
    """The seeds' loop: replicate params, reshape each batch to (n, b/n, ...),
    pmap a step that pmeans the gradients, read the loss only at the end."""
    x, y = synthetic(w, batch_size)
    graphdef, params = nnx.split(w.make())
    tx = optax.sgd(LR)
    devices = jax.local_devices()[:n]

    @functools.partial(jax.pmap, axis_name="devices", devices=devices, donate_argnums=(0, 1))
    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(functools.partial(_mean_loss, graphdef))(params, xb, yb)
        grads = jax.lax.pmean(grads, "devices")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "devices")

    # Seed 000's "Method 1": stack copies on the host; the first call places them.
    state = [replicate(params, n), replicate(tx.init(params), n)]
    per = batch_size // n
    n_batches = len(x) // batch_size

    def run(k):
        loss = None
        for i in range(k):
            j = i % n_batches
            xb = x[j * batch_size:(j + 1) * batch_size].reshape((n, per) + x.shape[1:])
            yb = y[j * batch_size:(j + 1) * batch_size].reshape(n, per)
            state[0], state[1], loss = train_step(state[0], state[1], xb, yb)
            if i % 2 == 1:  # XLA:CPU aborts if too many multi-device steps queue up
                loss.block_until_ready()
        float(loss[0])  # the seed's log line: one sync at the end

    return _first_call("pmap loop", run)


def bench_jit(w, batch_size) -> Method:
    x, y = synthetic(w, batch_size)
    graphdef, params = nnx.split(w.make())
    tx = optax.sgd(LR)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, xb, yb):
        grads = jax.grad(functools.partial(_mean_loss, graphdef))(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = [params, tx.init(params)]
    n_batches = len(x) // batch_size

    def run(k):
        for i in range(k):
            j = i % n_batches
            state[0], state[1] = train_step(state[0], state[1],
                                            x[j * batch_size:(j + 1) * batch_size],
                                            y[j * batch_size:(j + 1) * batch_size])
        jax.block_until_ready(state)

    return _first_call("jit 1 device", run)


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """This machine's f32 matmul FLOP/s on one device: the yardstick for mlp."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    return best


def run_bench(workloads, device_counts, repeats=5, steps=None, steps_per_call=8,
              sweep=True, out_dir="benchmarks/results", log=print) -> list[dict]:
    """Measure everything; write results.md, results.json and PNGs to `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    peak = matmul_peak()
    rows = []
    for name in workloads:
        w = WORKLOADS[name]
        s = steps or _auto_steps(w)
        jit = bench_jit(w, w.batch_size)
        for n in device_counts:
            if w.batch_size % n:
                continue
            methods = [bench_pmap_loop(w, n, w.batch_size), jit]
            methods += [bench_dpax(w, n, backend, w.batch_size)
                        for backend in ("shard_map", "pmap")]
            if steps_per_call > 1:
                methods.append(bench_dpax(w, n, "shard_map", w.batch_size, steps_per_call,
                                          f"dpax/k={steps_per_call}"))
            rates = time_interleaved(methods, s, repeats)
            loop_med = statistics.median(rates["pmap loop"])
            for m in methods:
                med = statistics.median(rates[m.name])
                row = {"workload": name, "devices": n, "method": m.name,
                       "compile_s": m.compile_s, "steps_per_sec": med, "min": min(rates[m.name]),
                       "vs_pmap_loop": med / loop_med, "memory_mib": m.memory / 2**20,
                       "batch_size": w.batch_size}
                if w.flops_per_example:
                    row["flops_frac"] = w.flops_per_example * w.batch_size * med / peak
                rows.append(row)
                log(_fmt_row(row))
    sweep_rows = _batch_sweep(repeats, steps) if sweep else []
    _write(rows, sweep_rows, peak, out_dir)
    return rows


def _auto_steps(w: Workload) -> int:
    """Steps per timed repeat: long enough (~0.1-2 s) that scheduling noise on a
    shared host averages out, and a multiple of 8 so --steps-per-call 8 runs
    whole calls only."""
    return {"tiny": 1024, "digits": 128, "mlp": 48, "cnn": 24}[w.name]


def _batch_sweep(repeats, steps, n=8):
    rows = []
    for name in ("mlp", "cnn"):
        w = WORKLOADS[name]
        s = max(5, (steps or _auto_steps(w)) // 2)
        for b in (64, 128, 256, 512, 1024):
            rates = time_interleaved([bench_pmap_loop(w, n, b),
                                      bench_dpax(w, n, "shard_map", b)], s, repeats)
            for method, r in rates.items():
                rows.append({"workload": name, "batch_size": b, "method": method,
                             "examples_per_sec": b * statistics.median(r)})
    return rows


def _fmt_row(r: dict) -> str:
    flops = f" {100 * r['flops_frac']:5.1f}%" if "flops_frac" in r else "     -"
    mem = "-" if np.isnan(r["memory_mib"]) else f"{r['memory_mib']:.1f}"
    return (f"| {r['workload']} | {r['devices']} | {r['method']} | {r['compile_s']:.2f} | "
            f"{r['steps_per_sec']:.1f} | {r['min']:.1f} | {r['vs_pmap_loop']:.2f}x | {mem} |"
            f"{flops} |")


def _write(rows, sweep_rows, peak, out_dir):
    header = ("| workload | N | method | compile s | steps/s median | steps/s min | "
              "vs pmap loop | step MiB/device | FLOP/s of peak |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    tunables = os.environ.get("GLIBC_TUNABLES") or "none"  # see dpax.hostenv
    text = [f"dpax bench, {time.strftime('%Y-%m-%d')}, {machine}, jax {jax.__version__}, "
            f"{jax.default_backend()}; matmul peak {peak / 1e9:.1f} GFLOP/s (f32, one device); "
            f"GLIBC_TUNABLES {tunables}",
            "", header] + [_fmt_row(r) for r in rows]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"rows": rows, "sweep": sweep_rows, "matmul_peak": peak}, f, indent=1)
    _plots(rows, sweep_rows, out_dir)


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
