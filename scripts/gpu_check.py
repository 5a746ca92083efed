"""What dpax does on one GPU, in one short run (a lent GPU's minutes are few).

    python scripts/gpu_check.py equivalence     # dpax vs a hand jit loop, params
    python scripts/gpu_check.py memory CASE     # `estimate` vs XLA vs the device's peak
    python scripts/gpu_check.py host BACKEND    # a `fit` call's host time, per function
    python scripts/gpu_check.py attention       # the GPT's bf16 step takes cuDNN's kernel

`equivalence`: the generic path (the one GPUs take) trains a CNN and a small
GPT with Adam for 20 steps; a hand-written `jax.jit` loop with the same model,
loss and optax chain trains from the same init on the same batches. Prints the
max |params difference|.

`attention`: GPT-2 small's shape in bf16: whether its compiled training step
calls cuDNN's fused attention, and its step time, with the platform's choice
and with XLA's attention; the two kernels' outputs on the same bf16 inputs.

`memory CASE`: a Trainer and six steps of a model in a process of their
own, so that the device's `peak_bytes_in_use` is theirs: the estimate
(`dpax.training.estimate`) against XLA's memory analysis of the compiled
step plus the model as built (what the device holds) and against the peak
the allocator saw. CASE is one of CASES.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpax.bench.baselines import step_memory
from dpax.cli.estimate import estimate_model
from dpax.models import losses
from dpax.models.registry import make_model
from dpax.training.trainer import Trainer

# name: (model, options, example shape, task, n_out, global batch, precision)
CASES = {
    "deep-mlp": ("deep-mlp", {}, (784,), "classification", 10, 256, "fp32"),
    "gpt-4x128": ("gpt", {"layers": 4, "width": 128, "heads": 4}, (257,), "lm", 256, 32,
                  "fp32"),
    "gpt-4x128-remat": ("gpt", {"layers": 4, "width": 128, "heads": 4, "remat": "block"},
                        (257,), "lm", 256, 32, "fp32"),
    # GPT-2 small's shape (12 x 768, 1024 tokens) on byte tokens, batch 8, bf16.
    "gpt2-small-bf16": ("gpt", {"layers": 12, "width": 768, "heads": 12}, (1025,), "lm", 256,
                        8, "bf16"),
    "gpt2-small-bf16-remat": ("gpt", {"layers": 12, "width": 768, "heads": 12,
                                      "remat": "block"}, (1025,), "lm", 256, 8, "bf16"),
}


def memory(case: str) -> None:
    name, options, shape, task, n_out, batch, precision = CASES[case]
    loss = losses.for_task(task)[0]
    dtype = jnp.uint8 if task == "lm" else jnp.float32
    example = {"x": jax.ShapeDtypeStruct(shape, dtype), "y": jax.ShapeDtypeStruct((), jnp.int32)}
    est = estimate_model(name, options, example, n_out, task, optax.adam(1e-3), batch, 1,
                         precision=precision)
    model = make_model(name, shape, n_out, 0, task, **options)
    t = Trainer(model, loss, optax.adam(1e-3), devices=1, precision=precision)
    rng = np.random.default_rng(0)
    hi = 256 if task == "lm" else n_out
    host = {"x": (rng.integers(0, 256, (batch, *shape)).astype(dtype) if task == "lm"
                  else rng.normal(size=(batch, *shape)).astype(dtype)),
            "y": rng.integers(0, hi, batch).astype(np.int32), "mask": np.ones(batch, bool)}
    compiled = t.lower_train_step(host, batch).compile()
    # The first device's need: the step's (XLA's analysis) and the model as built.
    xla = step_memory(compiled) + sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    t.train_step(host, batch)
    jax.block_until_ready(t.state)
    t0 = time.perf_counter()
    for _ in range(5):
        t.train_step(host, batch)
    jax.block_until_ready(t.state)
    ms = (time.perf_counter() - t0) / 5 * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", float("nan"))
    mib = 2**20
    print(f"MEMORY {case:22s} params {est.params / 1e6:7.1f}M  estimate "
          f"{est.memory['total'] / mib:9.1f} MiB  XLA + model {xla / mib:9.1f} MiB "
          f"({est.memory['total'] / xla:.2f}x)  device peak {peak / mib:9.1f} MiB "
          f"({est.memory['total'] / peak:.2f}x)  step {ms:.1f} ms  "
          f"flops/step {est.flops_per_step:.3g}")


def equivalence() -> None:
    for case, steps in (("cnn", 20), ("gpt", 20)):
        for seed in (0, 1, 2):
            diff = _one(case, steps, seed)
            print(f"EQUIV {case} seed {seed}: max |dpax - hand jit| over params {diff:.3g}")


def _one(case: str, steps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    if case == "cnn":
        shape, task, n_out, batch = (8, 8, 1), "classification", 10, 64
        x = rng.normal(size=(steps, batch, *shape)).astype(np.float32)
        y = rng.integers(0, n_out, (steps, batch)).astype(np.int32)
        opts = {}
    else:
        shape, task, n_out, batch = (65,), "lm", 256, 16
        x = rng.integers(0, 256, (steps, batch, *shape)).astype(np.uint8)
        y = np.full((steps, batch), shape[0], np.int32)  # every token real
        opts = {"layers": 2, "width": 64, "heads": 4}
    loss = losses.for_task(task)[0]
    make = lambda: make_model(case, shape, n_out, seed, task, **opts)  # noqa: E731
    tx = optax.adam(1e-3)
    t = Trainer(make(), loss, tx, devices=1, xla_cpu_tuning=False)
    for i in range(steps):
        t.train_step({"x": x[i], "y": y[i], "mask": np.ones(batch, bool)}, batch)
    ours = jax.tree.leaves(nnx.to_pure_dict(t.params))

    model = make()
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, rest, bx, by):
        def f(p):
            m = nnx.merge(graph, p, rest)
            out = loss(m, {"x": bx, "y": by})  # per example; an LM's also weighted
            w = out[2] if len(out) > 2 else jnp.ones_like(out[0])
            return jnp.sum(out[0] * w) / jnp.sum(w)
        g = jax.grad(f)(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt

    for i in range(steps):
        params, opt = step(params, opt, rest, x[i], y[i])
    hand = jax.tree.leaves(nnx.to_pure_dict(params))
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ours, hand))


def host(backend: str, workload: str = "gpt", steps: int = 192) -> None:
    """Where a `fit` call's host time goes on `backend`: steps/s of one call,
    then the same call under cProfile, its top functions per step (dpax/pmap
    ran the bench's GPT 0.68x the jit loop on an H100, shard_map 0.88x)."""
    import cProfile
    import pstats

    from dpax.bench.workloads import WORKLOADS, synthetic

    w = WORKLOADS[workload]
    x, y = synthetic(w, w.batch_size)
    t = Trainer(w.make(), w.loss(), w.tx(), devices=1, backend=backend)
    done = [0]

    def fit(k):
        done[0] += k
        t.fit(x, y, batch_size=w.batch_size, until_step=done[0], log_every=10**9)

    fit(steps)  # compiles
    t0 = time.perf_counter()
    fit(steps)
    print(f"HOST {workload} {backend}: {steps / (time.perf_counter() - t0):.1f} steps/s")
    profile = cProfile.Profile()
    profile.enable()
    fit(steps)
    profile.disable()
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]  # by own time
    for (file, line, fn), (_, calls, tottime, _, _) in rows:
        print(f"  {1e6 * tottime / steps:8.1f} us/step  {calls / steps:6.1f} calls/step  "
              f"{file.rsplit('/', 1)[-1]}:{line}({fn})")


def attention(case: str = "gpt2-small-bf16", steps: int = 5) -> None:
    from dpax.models import gpt

    name, options, shape, task, n_out, batch, precision = CASES[case]
    rng = np.random.default_rng(0)
    host = {"x": rng.integers(0, 256, (batch, *shape)).astype(np.uint8),
            "y": rng.integers(0, 256, batch).astype(np.int32), "mask": np.ones(batch, bool)}
    chosen = gpt.causal_attention
    for kind in ("platform's", "xla"):
        if kind == "xla":
            gpt.causal_attention = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="xla")
        t = Trainer(make_model(name, shape, n_out, 0, task, **options), losses.lm_loss,
                    optax.adam(1e-3), devices=1, precision=precision)
        # cuDNN's fused attention is a custom call named for fused multi-head attention.
        fused = "fmha" in t.lower_train_step(host, batch).compile().as_text().lower()
        t.train_step(host, batch)
        jax.block_until_ready(t.state)
        t0 = time.perf_counter()
        for _ in range(steps):
            t.train_step(host, batch)
        jax.block_until_ready(t.state)
        ms = (time.perf_counter() - t0) / steps * 1e3
        print(f"ATTENTION {case} {kind}: cuDNN in the step: {fused}; step {ms:.1f} ms",
              flush=True)
    gpt.causal_attention = chosen
    heads = options["heads"]
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, shape[0] - 1, heads,
                                                    options["width"] // heads), jnp.bfloat16)
    xla = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    diff = jnp.max(jnp.abs(gpt.causal_attention(q, k, v).astype(jnp.float32) - xla))
    print(f"ATTENTION max |platform's - XLA's| on bf16 inputs: {float(diff):.3g}")


if __name__ == "__main__":
    print(f"jax {jax.__version__} {jax.devices()}", flush=True)
    if sys.argv[1] == "memory":
        memory(sys.argv[2])
    elif sys.argv[1] == "host":
        host(*sys.argv[2:3])
    elif sys.argv[1] == "attention":
        attention(*sys.argv[2:3])
    else:
        equivalence()
