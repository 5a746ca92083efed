"""The GPT-2-small shape's MFU on one GPU: dpax's `Trainer.fit` in each
precision policy, attention and batch size, against a hand-written `jax.jit`
loop with the same model and Adam, and where each step's time goes.

    python scripts/gpu_mfu.py                    # every variant, then the profiles
    python scripts/gpu_mfu.py --small            # a CPU smoke run of the same code

Each variant: a Trainer (or the hand loop) is built, its first call compiles,
then `--repeats` timed calls of enough steps to last ~1 s; the median is
reported as ms/step, tokens/s and MFU against the device's data-sheet peak
(`dpax.parallel.peak`), FLOPs as `dpax.models.gpt.flops_per_token` counts them.
The profile sums each device kernel's time over a few steps (`jax.profiler`),
grouped by what it is (matmul, attention, fusion, copy, reduction).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dpax.bench.workloads import Workload, synthetic
from dpax.models import gpt, losses
from dpax.parallel import peak
from dpax.training import compute
from dpax.training import step as step_module
from dpax.training.trainer import Trainer

SHAPES = {"gpt2-small": dict(layers=12, width=768, heads=12, seq=1024),
          "small": dict(layers=2, width=64, heads=4, seq=64)}


def workload(shape: dict) -> Workload:
    seq = shape["seq"]
    dims = {k: shape[k] for k in ("layers", "width", "heads")}
    return Workload("gpt", (seq + 1,), 8,
                    lambda: gpt.GPT(256, seq, **dims, rngs=nnx.Rngs(0)), task="lm")


def flops_per_step(shape: dict, batch: int) -> float:
    """The weights counted from the shapes, the position table left out (as
    `dpax.bench.workloads` counts its GPT's)."""
    d, layers, seq = shape["width"], shape["layers"], shape["seq"]
    n = 256 * d + layers * (12 * d * d + 13 * d) + 2 * d
    return gpt.flops_per_token(n, layers, d, seq) * seq * batch


def xla_attention(q, k, v, segments=None):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _merge_only(graphdef, params, rest, dtype):
    """The step's model before `dpax.training.compute` set embeddings' dtype:
    the params cast, an `nnx.Embed` left in float32."""
    return nnx.merge(graphdef, compute.cast_floats(params, dtype), rest)


def dpax_run(w: Workload, batch: int, attention: str = "platform", reorder: bool = True,
             embed_fix: bool = True, **options):
    """`run(k)`: k steps of `Trainer.fit`, waited for."""
    chosen, made, merge = (gpt.causal_attention, step_module.ReduceBeforeTranspose,
                           step_module.model_in)
    if attention == "xla":
        gpt.causal_attention = xla_attention
    if not reorder:
        step_module.ReduceBeforeTranspose = lambda: None
    if not embed_fix:
        step_module.model_in = _merge_only
    try:
        x, y = synthetic(w, batch, 4)
        t = Trainer(w.make(), losses.lm_loss, optax.adam(3e-4), devices=1,
                    xla_cpu_tuning=False, **options)
        done = [0]

        def run(k):
            done[0] += k
            t.fit(x, y, batch_size=batch, until_step=done[0], log_every=10**9)
            jax.block_until_ready(t.state)
        run(2)  # traces and compiles while the patches hold
    finally:
        gpt.causal_attention, step_module.ReduceBeforeTranspose = chosen, made
        step_module.model_in = merge
    return run, t


def hand_run(w: Workload, batch: int, precision: str):
    """A jit loop as a user writes it: the same model computing in bf16 on
    fp32 master params, Adam, the loss read at the end."""
    x, _ = synthetic(w, batch, 4)
    graphdef, params, rest = nnx.split(w.make(), nnx.Param, ...)
    tx = optax.adam(3e-4)
    state = [params, tx.init(params)]
    dtype = jnp.bfloat16 if precision == "bf16" else None

    def loss(params, xb):  # the model as dpax's step computes it in `dtype`
        model = compute.model_in(graphdef, params, rest, dtype)
        logits = model(xb[:, :-1]).astype(jnp.float32)  # the loss in f32, as lm_loss
        labels = xb[:, 1:].astype(jnp.int32)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
                jnp.mean(jnp.argmax(logits, -1) == labels))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, xb):
        (value, accuracy), grads = jax.value_and_grad(loss, has_aux=True)(params, xb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    n = len(x) // batch

    def run(k):
        value = None
        for i in range(k):
            j = i % n
            state[0], state[1], value = train_step(state[0], state[1],
                                                   x[j * batch:(j + 1) * batch])
        jax.block_until_ready(state)
        float(value)
    run(2)
    return run, None


def timed(run, repeats: int) -> float:
    """Median seconds per step over `repeats` calls of ~1 s each."""
    t0 = time.perf_counter()
    run(2)
    one = (time.perf_counter() - t0) / 2
    k = max(2, int(1.0 / max(one, 1e-4)))
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(k)
        rates.append((time.perf_counter() - t0) / k)
    return statistics.median(rates)


def profile(run, steps: int = 3, top: int = 14) -> None:
    """Device time per step of each kernel, from a `jax.profiler` trace."""
    with tempfile.TemporaryDirectory() as where:
        with jax.profiler.trace(where):
            run(steps)
        import glob
        path = glob.glob(f"{where}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    times: collections.Counter = collections.Counter()
    device = [p for p in data.planes if p.name.startswith("/device:")]
    planes = device or [p for p in data.planes if p.name.startswith("/host:CPU")]
    print("  lines: " + "; ".join(f"{p.name} {ln.name} ({len(list(ln.events))})"
                                  for p in planes for ln in p.lines)[:600])
    for plane in planes:
        # A GPU plane's kernels are on its stream lines (others repeat them
        # as XLA's ops and modules); a CPU's on XLA's thread pools.
        streams = [line for line in plane.lines if "stream" in line.name.lower()]
        cpu = [line for line in plane.lines if line.name.startswith("tf_XLA")]
        for line in (streams or cpu):
            for event in line.events:
                times[event.name] += event.duration_ns
    total = sum(times.values())
    kinds: collections.Counter = collections.Counter()
    for name, ns in times.items():
        kinds[_kind(name)] += ns
    print(f"  device busy {total / steps / 1e6:.2f} ms/step; by kind: " + ", ".join(
        f"{k} {v / steps / 1e6:.2f}" for k, v in kinds.most_common()), flush=True)
    for name, ns in times.most_common(top):
        print(f"    {ns / steps / 1e6:7.3f} ms  {name[:110]}")
    if device:
        gaps(max((line for p in planes for line in p.lines), key=lambda ln: len(list(ln.events))),
             steps)


def gaps(line, steps: int, top: int = 10) -> None:
    """Where the device idles on its busiest stream: the time between one
    kernel's end and the next one's start, in all and the longest ones."""
    events = sorted(line.events, key=lambda e: e.start_ns)
    idle = [(b.start_ns - a.end_ns, a.name, b.name) for a, b in zip(events, events[1:])]
    total = sum(g for g, _, _ in idle if g > 0)
    long = [g for g, _, _ in idle if g > 50e3]
    print(f"  idle between kernels {total / steps / 1e6:.2f} ms/step over {len(events)} kernels;"
          f" {len(long)} gaps > 50 us hold {sum(long) / steps / 1e6:.2f} ms/step", flush=True)
    for g, before, after in sorted(idle, reverse=True)[:top]:
        print(f"    {g / 1e6:7.3f} ms  after {before[:50]}  before {after[:50]}")


def _kind(name: str) -> str:
    low = name.lower()
    for kind, marks in (("attention", ("fmha", "flash", "cudnn")),
                        ("matmul", ("gemm", "cublas", "cutlass", "dot", "sm90_xmma", "nvjet",
                                    "triton_gemm", "matmul")),
                        ("reduction", ("reduce",)), ("copy", ("copy", "memcpy", "memset",
                                                              "transpose")),
                        ("fusion", ("fusion", "loop_", "input_", "triton"))):
        if any(m in low for m in marks):
            return kind
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a tiny shape (a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--turns", action="store_true",
                    help="build the --only variants, then time them in turns: each "
                    "repeat times every variant once, so a change in the machine hits all")
    args = ap.parse_args()
    shape = SHAPES["small" if args.small else "gpt2-small"]
    w = workload(shape)
    device = jax.devices()[0]
    print(f"jax {jax.__version__} {device.device_kind} {shape}", flush=True)
    big, small = (32, 8) if not args.small else (8, 4)
    variants = {  # name: (batch, how), in the order a short lease must see them
        "dpax-bf16-b8-before": (small, lambda b: dpax_run(w, b, embed_fix=False,
                                                          precision="bf16")),
        "dpax-bf16-b8": (small, lambda b: dpax_run(w, b, precision="bf16")),
        "hand-bf16-b8": (small, lambda b: hand_run(w, b, "bf16")),
        "dpax-bf16-b32": (big, lambda b: dpax_run(w, b, precision="bf16")),
        "hand-bf16-b32": (big, lambda b: hand_run(w, b, "bf16")),
        "dpax-bf16-xla-b32": (big, lambda b: dpax_run(w, b, "xla", precision="bf16")),
        "dpax-fp32-b8": (small, lambda b: dpax_run(w, b, precision="fp32")),
        "dpax-allbf16-b32": (big, lambda b: dpax_run(w, b, precision="bf16",
                                                     param_dtype="bf16",
                                                     opt_state_dtype="bf16")),
        "dpax-bf16-b64": (2 * big, lambda b: dpax_run(w, b, precision="bf16")),
        "dpax-bf16-b32-noreorder": (big, lambda b: dpax_run(w, b, reorder=False,
                                                            precision="bf16")),
    }
    profiled = ("dpax-bf16-b32", "hand-bf16-b32")
    only = [v for v in args.only.split(",") if v]
    if args.turns:
        return in_turns({v: variants[v] for v in only}, args.repeats)
    for name, (batch, how) in variants.items():
        if only and name not in only:
            continue
        precision = "fp32" if "fp32" in name else "bf16"
        top = peak.for_devices([device], precision)
        try:
            t0 = time.perf_counter()
            run, trainer = how(batch)
            first = time.perf_counter() - t0
            s = timed(run, args.repeats)
        except Exception as error:  # e.g. out of memory: the next variant still runs
            print(f"MFU {name}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        flops = flops_per_step(shape, batch)
        print(f"MFU {name:26s} batch {batch:3d}  first call {first:6.1f} s  "
              f"{s * 1e3:8.2f} ms/step  {batch * shape['seq'] / s:10.0f} tokens/s  "
              f"{flops / s / 1e12:7.1f} TFLOP/s  MFU {flops / s / top.flops:.3f}", flush=True)
        if name in profiled and not args.no_profile:
            print(f"PROFILE {name}", flush=True)
            try:
                profile(run)
            except Exception as error:
                print(f"  failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        del run, trainer
        gc.collect()


def in_turns(variants: dict, repeats: int) -> None:
    """Seconds per step of each variant, timed in turns, and each one's
    median ratio to the first's over the repeats (paired)."""
    runs = {name: how(batch)[0] for name, (batch, how) in variants.items()}
    steps = {name: max(2, int(1.0 / timed(run, 1))) for name, run in runs.items()}
    times: dict = {name: [] for name in runs}
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            t0 = time.perf_counter()
            runs[name](steps[name])
            times[name].append((time.perf_counter() - t0) / steps[name])
    first = next(iter(runs))
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(times[first], ts)]  # > 1: faster than the first
        print(f"TURNS {name:26s} {statistics.median(ts) * 1e3:8.2f} ms/step (median of "
              f"{repeats}); speed over {first}: median {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]", flush=True)


if __name__ == "__main__":
    sys.exit(main())
