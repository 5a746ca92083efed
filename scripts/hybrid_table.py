"""Hybrid sharding (`--replicas`) against one device, and what it holds and moves.

For each layout in groups: the largest |params difference| from one device
after 10 Adam steps on digits (an MLP of width 23, so leaves are padded; an
uneven batch of 61), for three init seeds; then, on the bench's mlp workload,
the state bytes one device holds at rest, and the compiled step's collective
bytes inside and across the groups against the least the layout needs.

    python scripts/hybrid_table.py    # 8 simulated devices, about 3 minutes on 2 cores
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import dpax  # noqa: E402
from dpax.bench.baselines import compiled_step, step_comms  # noqa: E402
from dpax.bench.workloads import WORKLOADS  # noqa: E402

CONFIGS = [("full", 4, 2), ("optimizer", 8, 4), ("full", 8, 2), ("full", 8, 1)]


def params_after(seed: int, devices: int, **kw) -> list:
    ds = dpax.data.digits()
    model = dpax.models.MLP(ds.input_shape, ds.n_out, hidden=23, rngs=nnx.Rngs(seed))
    t = dpax.Trainer(model, dpax.classification_loss, optax.adam(3e-3), devices=devices, **kw)
    t.fit(ds.x_train, ds.y_train, batch_size=61, until_step=10, log_every=10)
    return jax.tree.leaves(t.params)


def at_rest(t) -> int:
    """Bytes of the state on the first device."""
    first = t.backend.devices[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(t.state) if isinstance(leaf, jax.Array)
               for s in leaf.addressable_shards if s.device == first)


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def main() -> None:
    refs = {seed: params_after(seed, 1) for seed in (0, 1, 2)}
    print("| layout | devices | groups | max abs params diff vs 1 device, seeds 0/1/2 |")
    print("|---|---|---|---|")
    for sharding, n, r in CONFIGS:
        diffs = []
        for seed, ref in refs.items():
            got = params_after(seed, n, sharding=sharding, replicas=r)
            diffs.append(max(float(abs(a - b).max()) for a, b in zip(got, ref)))
        print(f"| {sharding} | {n} | {r} | " + " / ".join(f"{d:.1e}" for d in diffs) + " |")
    w = WORKLOADS["mlp"]
    print("\nmlp workload (Adam), MiB: state per device at rest; collectives per step, "
          "found (least)")
    print("| layout | devices | groups | state at rest | reduce-scatter | all-gather | "
          "across groups: all-reduce |")
    print("|---|---|---|---|---|---|---|")
    for sharding, n, r in CONFIGS:
        t = dpax.Trainer(w.make(), w.loss(), w.tx(), devices=n, sharding=sharding, replicas=r)
        c = step_comms(t, compiled_step(t, w.batch_size, w))

        def cell(kind, c=c):
            found = c["found"].get(kind, {}).get("bytes", 0)
            return f"{mib(found)} ({mib(c['minimum'].get(kind, 0))})"

        across = dpax.parallel.comms.ACROSS + "all-reduce"
        print(f"| {sharding} | {n} | {r} | {mib(at_rest(t))} | {cell('reduce-scatter')} | "
              f"{cell('all-gather')} | {cell(across) if r > 1 else '-'} |")


if __name__ == "__main__":
    main()
