"""dpax against PyTorch DistributedDataParallel on the benchmark cnn or gpt.

The same network (`--workload cnn`: conv 3x3 32 - relu - 2x2 max pool - conv
3x3 64 - relu - 2x2 max pool - dense 10, on 32x32x3, global batch 128;
`--workload gpt`: the bench's GPT, 4 blocks of width 128, 4 heads, 64 bytes,
global batch 32, as Hugging Face's GPT2LMHeadModel, which dpax's GPT equals:
tests/test_hf_gpt2.py), Adam (lr 1e-3) and random data of the same shapes.
PyTorch runs DDP over gloo in persistent worker processes that wait for a
command while dpax runs, so the methods take turns in every repeat (this host
is shared) like `dpax bench`'s:

  dpax/shard_map N=..   `Trainer.fit`, N simulated devices (the public API)
  pmap loop N=..        the seeds' loop with the same Adam (loss and accuracy each step,
                        as dpax's built-in loss computes them; the torch loops compute
                        the loss alone, which only favours them)
  torch DDP P procs     P processes, global batch / P each, T threads each
  torch 1 proc          one process, the whole batch

Needs PyTorch (and transformers for the GPT): dpax's interop extra.

    python scripts/torch_ddp_bench.py --devices 2,4 --repeats 7
    python scripts/torch_ddp_bench.py --workload gpt --devices 2,4 --procs 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

BATCH, SHAPE, CLASSES, LR = 128, (32, 32, 3), 10, 1e-3
GPT_BATCH, GPT_SEQ = 32, 64  # the bench's GPT workload (dpax.bench.workloads)


def _torch_cnn():
    import torch.nn as tnn

    # Flax's Conv pads SAME; 3x3 with padding 1 is the same shape.
    return tnn.Sequential(
        tnn.Conv2d(3, 32, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Conv2d(32, 64, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Flatten(), tnn.Linear(64 * 8 * 8, CLASSES))


def _torch_gpt():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=GPT_SEQ, n_embd=128,
                                      n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _torch_data(rows: int, channels_last: bool, workload: str = "cnn"):
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    if workload == "gpt":  # random bytes, windows of GPT_SEQ + 1
        x = torch.from_numpy(rng.integers(0, 256, (8, rows, GPT_SEQ + 1)).astype(np.int64))
        return x, None
    x = torch.from_numpy(rng.normal(size=(8, rows, SHAPE[2], *SHAPE[:2])).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, CLASSES, (8, rows)).astype(np.int64))
    if channels_last:
        x = torch.stack([b.contiguous(memory_format=torch.channels_last) for b in x])
    return x, y


def _torch_worker(rank, procs, threads, channels_last, port, commands, results,
                  workload="cnn"):
    """One DDP process (or the single process when procs == 1): train k steps
    per command, report the seconds they took (between two barriers)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _torch_gpt() if workload == "gpt" else _torch_cnn()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if procs > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=procs)
        model = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    batch = GPT_BATCH if workload == "gpt" else BATCH
    x, y = _torch_data(batch // procs, channels_last, workload)

    def loss_of(i):
        if workload == "gpt":
            logits = model(x[i][:, :-1]).logits
            return loss_fn(logits.reshape(-1, 256), x[i][:, 1:].reshape(-1))
        return loss_fn(model(x[i]), y[i])

    step = 0
    while (k := commands.get()) is not None:
        if procs > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(step % 8)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            opt.step()
            step += 1
        loss.item()
        if procs > 1:
            dist.barrier()
        results.put(time.perf_counter() - t0)
    if procs > 1:
        dist.destroy_process_group()


class TorchMethod:
    """A `dpax.bench.timing.Method`-like handle on persistent torch processes."""

    def __init__(self, name, procs, threads, channels_last, port, workload="cnn"):
        ctx = mp.get_context("spawn")
        self.name, self.compile_s = name, 0.0
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(procs)]
        self.procs = [ctx.Process(target=_torch_worker, daemon=True,
                                  args=(r, procs, threads, channels_last, port, q, self.results,
                                        workload))
                      for r, q in enumerate(self.commands)]
        for p in self.procs:
            p.start()

    def run(self, k: int) -> None:
        for q in self.commands:
            q.put(k)
        for _ in self.procs:
            self.results.get()

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="cnn", choices=["cnn", "gpt"])
    parser.add_argument("--devices", default="2,4", help="dpax device counts")
    parser.add_argument("--procs", type=int, default=2, help="DDP processes")
    parser.add_argument("--threads", default="1", help="torch threads per DDP process, e.g. 1,2")
    parser.add_argument("--channels-last", action="store_true", help="torch in NHWC too")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=24, help="steps per timed repeat")
    args = parser.parse_args()
    counts = [int(n) for n in args.devices.split(",")]

    import jax

    jax.config.update("jax_num_cpu_devices", max(counts))
    import dataclasses

    from dpax.bench.baselines import bench_dpax, bench_pmap_loop
    from dpax.bench.timing import time_interleaved
    from dpax.bench.workloads import WORKLOADS

    w = dataclasses.replace(WORKLOADS[args.workload], optimizer="adam")
    batch = w.batch_size
    assert (batch, w.input_shape) == ((GPT_BATCH, (GPT_SEQ + 1,)) if args.workload == "gpt"
                                      else (BATCH, SHAPE))
    torch_methods = [TorchMethod(f"torch DDP {args.procs} procs x {t} threads", args.procs,
                                 int(t), args.channels_last, 29500 + i, args.workload)
                     for i, t in enumerate(args.threads.split(","))]
    torch_methods.append(TorchMethod("torch 1 proc", 1, os.cpu_count(), args.channels_last, 0,
                                     args.workload))
    methods = list(torch_methods)
    for n in counts:
        methods += [dataclasses.replace(bench_pmap_loop(w, n, batch), name=f"pmap loop N={n}"),
                    dataclasses.replace(bench_dpax(w, n, "shard_map", batch),
                                        name=f"dpax/shard_map N={n}")]
    try:
        rates = time_interleaved(methods, args.steps, args.repeats)
    finally:
        for m in torch_methods:
            m.close()
    ddp = statistics.median(rates[torch_methods[0].name])
    tunables = os.environ.get("GLIBC_TUNABLES") or "none"
    print(f"{args.workload}, batch {batch}, Adam {LR}, {args.steps} steps x {args.repeats} "
          "repeats, "
          f"{os.cpu_count()} cores, GLIBC_TUNABLES {tunables}, channels_last "
          f"{args.channels_last}; steps/s")
    print("| method | median | min | max | vs first DDP row |\n|---|---:|---:|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.2f} | {min(r):.2f} | {max(r):.2f} | "
              f"{statistics.median(r) / ddp:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
