"""Memory of one device under each mixed-precision policy (compute, params,
optimizer state), Adam on 1 device: `dpax estimate`'s count against XLA's
memory analysis of the compiled step (arguments + temporaries + outputs -
aliased), for deep-mlp (batch 256) and a 4 x 256 GPT (16 windows of 256).

    python scripts/precision_memory.py [deep-mlp] [gpt-4x256]

benchmarks/README.md ("Mixed-precision policies") keeps the measured rows.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpax
from dpax.bench.baselines import step_memory
from dpax.cli.estimate import estimate_model
from dpax.models import losses
from dpax.models.registry import make_model
from dpax.training.optim import state_stored_in
from dpax.training.trainer import Trainer

# name: (model, options, example shape, task, outputs, batch)
CASES = {"deep-mlp": ("deep-mlp", {}, (784,), "classification", 10, 256),
         "gpt-4x256": ("gpt", {"layers": 4, "width": 256, "heads": 4}, (257,), "lm", 256, 16)}
# (compute, params, optimizer state)
POLICIES = [("fp32", "fp32", "fp32"), ("bf16", "fp32", "fp32"), ("bf16", "fp32", "bf16"),
            ("bf16", "bf16", "bf16")]
MIB = 2**20


def row(case: str, precision: str, param: str, opt: str) -> str:
    name, options, shape, task, n_out, batch = CASES[case]
    tx = optax.adam(1e-3)
    dtype = jnp.uint8 if task == "lm" else jnp.float32
    example = {"x": jax.ShapeDtypeStruct(shape, dtype), "y": jax.ShapeDtypeStruct((), jnp.int32)}
    est = estimate_model(name, options, example, n_out, task,
                         tx if opt == "fp32" else state_stored_in(tx, jnp.bfloat16), batch, 1,
                         precision=precision, param_dtype=param).memory
    t = Trainer(make_model(name, shape, n_out, 0, task, **options), losses.for_task(task)[0],
                tx, devices=1, precision=precision, param_dtype=param, opt_state_dtype=opt,
                compile_cache="none")  # XLA compiles it here, as it measures
    rng = np.random.default_rng(0)
    host = {"x": (rng.integers(0, 256, (batch, *shape)).astype(dtype) if task == "lm"
                  else rng.normal(size=(batch, *shape)).astype(dtype)),
            "y": rng.integers(0, 256 if task == "lm" else n_out, batch).astype(np.int32),
            "mask": np.ones(batch, bool)}
    xla = step_memory(t.lower_train_step(host, batch).compile())
    return (f"| {case} | {precision} | {param} | {opt} | {est['params'] / MIB:.1f} / "
            f"{est['optimizer'] / MIB:.1f} / {est['total'] / MIB:.1f} MiB | {xla / MIB:.1f} MiB |")


def main() -> None:
    dpax.simulate_devices(1)
    print("| model | compute | params | optimizer state | estimate: params / optimizer / total "
          "| XLA's step |\n|---|---|---|---|---|---|")
    for case in sys.argv[1:] or CASES:
        for policy in POLICIES:
            print(row(case, *policy), flush=True)


if __name__ == "__main__":
    main()
