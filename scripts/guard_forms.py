"""What skipping a non-finite step costs a hand-written jit loop, in each form
the guard can take, on one device of any platform.

    python scripts/guard_forms.py --workloads mlp,digits,gpt

The forms, each a jitted step with its state donated:
  none    no guard: the loop a user writes by hand;
  branch  `lax.cond` around the optimizer's update (dpax's form,
          `dpax.training.update`);
  select  the update always computed, then `jnp.where(finite, new, old)` per leaf.

Every form waits for the whole gradient before it updates anything: the
verdict needs the gradient's norm. A select needs no branch, but XLA may keep
the old optimizer moments alive next to the new ones; a conditional on
XLA:GPU copies its predicate to the host and blocks the host until the
device gets there (XLA's `ConditionalThunk`). This script measures both:
steps/s (medians of interleaved repeats, batches already on the device) and
XLA's temporary bytes for the step. Results: benchmarks/README.md, "The
non-finite guard's forms".
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import optax

from dpax.bench.baselines import _split
from dpax.bench.timing import Method, time_interleaved
from dpax.bench.workloads import WORKLOADS, synthetic
from dpax.training.update import sum_of_squares


def _steps(w):
    """{form: step(state, x, y) -> state}: the same loss and optimizer."""
    mean_loss, params = _split(w)
    tx = w.tx()

    def grads(p, xb, yb):
        (loss, _), g = jax.value_and_grad(mean_loss, has_aux=True)(p, xb, yb)
        return g, jnp.isfinite(sum_of_squares(g)) & jnp.isfinite(loss)

    def apply(p, o, g):
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o

    def none(s, xb, yb):
        p, o = s
        return apply(p, o, grads(p, xb, yb)[0])

    def branch(s, xb, yb):
        p, o = s
        g, finite = grads(p, xb, yb)
        return jax.lax.cond(finite, lambda: apply(p, o, g), lambda: (p, o))

    def select(s, xb, yb):
        p, o = s
        g, finite = grads(p, xb, yb)
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), apply(p, o, g), s)

    state = (params, tx.init(params))
    return state, {"none": none, "branch": branch, "select": select}


def methods(w) -> tuple[list[Method], dict[str, int]]:
    """One timed loop per form on the first device; the batches are put on
    the device first, so that a host copy per step does not hide a host wait."""
    x, y = synthetic(w, w.batch_size)
    b = w.batch_size
    batches = [jax.device_put((x[i:i + b], y[i:i + b])) for i in range(0, len(x), b)]
    state, steps = _steps(w)
    out, temp = [], {}
    for name, fn in steps.items():
        step = jax.jit(fn, donate_argnums=(0,))
        temp[name] = step.lower(state, *batches[0]).compile().memory_analysis().temp_size_in_bytes
        held = [jax.tree.map(jnp.array, state)]

        def run(k, step=step, held=held):
            for i in range(k):
                held[0] = step(held[0], *batches[i % len(batches)])
            jax.block_until_ready(held[0])

        run(1)
        out.append(Method(name, 0.0, run))
    return out, temp


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,digits,gpt")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax {jax.__version__}")
    print("| workload | form | steps/s | vs none | XLA temp MB |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        ms, temp = methods(w)
        rates = {k: statistics.median(v)
                 for k, v in time_interleaved(ms, w.steps, args.repeats).items()}
        for form, rate in rates.items():
            print(f"| {name} | {form} | {rate:.1f} | {rate / rates['none']:.3f}x "
                  f"| {temp[form] / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
