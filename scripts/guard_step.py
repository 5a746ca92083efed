"""What the non-finite guard costs dpax's compiled step alone, on N devices.

    python scripts/guard_step.py --workload cnn --devices 8 --repeats 15

Two Trainers of the generic path (the XLA:CPU tuning off), with and without
`skip_nonfinite`, each calling its compiled step on one batch already placed
on its devices, so the host's batch work is left out: what differs is the
step's own program (the pass over the gradient for its norm, and the branch
around the update). They take turns (`dpax.bench.timing.time_interleaved`);
the ratio is each turn's, paired (`paired_ratio`). On one device a hand
`jit` step on the same resident batch takes turns too. Results:
benchmarks/README.md, "The guard's small leaves as one reduction".
"""

from __future__ import annotations

import argparse
import functools
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="cnn")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps per turn")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

    import jax
    import numpy as np
    import optax

    import dpax
    from dpax.bench.baselines import _split
    from dpax.bench.timing import Method, time_interleaved
    from dpax.bench.workloads import WORKLOADS, synthetic
    from dpax.data.batches import MASK
    from dpax.ratios import paired_ratio

    w = WORKLOADS[args.workload]
    x, y = synthetic(w, w.batch_size, n_batches=1)
    batch = {"x": x, "y": y, MASK: np.ones(len(x), bool)}

    def method(name: str, skip: bool) -> Method:
        t = dpax.Trainer(w.make(), w.loss(), w.tx(), devices=args.devices,
                         xla_cpu_tuning=False, skip_nonfinite=skip)
        placed = jax.device_put(batch, t.backend._rows)
        sums = [t._zero_sums(None, batch)]

        def run(k: int) -> None:
            for _ in range(k):
                sums[0] = t._run(1, placed, sums[0])
            jax.block_until_ready((t._leaves, sums[0]))

        run(1)  # compile
        return Method(name, 0.0, run)

    def hand() -> Method:
        """A hand-written `jit` step on one device, on the same resident batch."""
        mean_loss, params = _split(w)
        tx = w.tx()
        state = [params, tx.init(params)]
        xb, yb = jax.device_put(x), jax.device_put(y)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state):
            (_, _), grads = jax.value_and_grad(mean_loss, has_aux=True)(params, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def run(k: int) -> None:
            for _ in range(k):
                state[0], state[1] = step(*state)
            jax.block_until_ready(state)

        run(1)
        return Method("hand jit", 0.0, run)

    methods = [method("guard", True), method("none", False)]
    if args.devices == 1:
        methods.append(hand())
    rates = time_interleaved(methods, args.steps, args.repeats)
    for m in methods:
        vs = ", ".join(f"vs {o.name} {r.median:.3f} [{r.low:.3f}, {r.high:.3f}]" for o in methods
                       if o is not m
                       for r in [paired_ratio(rates[m.name], rates[o.name])])
        print(f"{w.name} N={args.devices} {m.name}: {np.median(rates[m.name]):.2f} steps/s, {vs}",
              flush=True)


if __name__ == "__main__":
    main()
