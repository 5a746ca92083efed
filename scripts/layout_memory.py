"""Memory of each state layout for `--model deep-mlp` (7 hidden layers of
4096, ~101M params on digits): bytes at rest on the first device (the arrays'
own shards) and the compiled step's need per device (XLA's memory analysis:
arguments + temporaries + outputs - aliased), Adam, global batch 128.

    python scripts/layout_memory.py --devices 8

Prints a Markdown table; benchmarks/README.md keeps the measured rows.
"""

from __future__ import annotations

import argparse

import dpax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--layouts", default="replicated,optimizer,full")
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()
    dpax.simulate_devices(args.devices)

    import numpy as np
    import optax

    from dpax.bench.baselines import state_bytes

    ds = dpax.data.digits()
    mib = 2**20
    print("| layout | state at rest MiB/device | step MiB/device | step temporaries MiB |")
    print("| --- | --- | --- | --- |")
    for layout in args.layouts.split(","):
        model = dpax.models.make_model("deep-mlp", ds.input_shape, ds.n_out, 0, "classification")
        t = dpax.Trainer(model, dpax.classification_loss, optax.adam(1e-3), devices=args.devices,
                         sharding=layout, grad_accum=args.grad_accum)
        size = t.padded(args.batch_size)
        host = {"x": ds.x_train[:size], "y": ds.y_train[:size], "mask": np.ones(size, bool)}
        m = t.lower_train_step(host, size).compile().memory_analysis()
        step = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                - m.alias_size_in_bytes)
        print(f"| {layout} | {state_bytes(t) / mib:.1f} | {step / mib:.1f} | "
              f"{m.temp_size_in_bytes / mib:.1f} |", flush=True)
        del t


if __name__ == "__main__":
    main()
