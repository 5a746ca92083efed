"""Streamed vs in-memory training on a dataset bigger than a process should hold.

Generates N uint8 32x32x3 images (labels: a fixed linear function of the
pixels, so the cnn has something to learn) as ArrayRecord shards and as one
.npz, then trains the cnn on 8 simulated devices from each: streamed on the
training thread, streamed with Grain workers, and in memory. Reports steps/s
(dpax's steady rate) and the peak RSS of the training process (and of its
worker processes, summed), sampled from /proc, next to the dataset's size.

    python scripts/streaming_bench.py --dir /tmp/dpax-stream --examples 1400000
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np

SHAPE = (32, 32, 3)
CHUNK = 16384


def chunks(n: int, seed: int = 0):
    """(x, y) chunks of the generated set. The label weighs 4x4 blocks of
    pixels alike (a smooth projection), so a small cnn can learn it."""
    coarse = np.random.default_rng(seed).normal(size=(8, 8, 3, 10))
    proj = coarse.repeat(4, 0).repeat(4, 1).reshape(-1, 10)
    for lo in range(0, n, CHUNK):
        rng = np.random.default_rng([seed, lo])
        x = rng.integers(0, 256, (min(CHUNK, n - lo),) + SHAPE, dtype=np.uint8)
        y = ((x.reshape(len(x), -1) / 255.0 - 0.5) @ proj).argmax(-1).astype(np.int32)
        yield x, y


def generate(directory: str, n: int, npz: bool) -> None:
    from dpax.data.prepare import write_shards

    shards = os.path.join(directory, "shards")
    if not os.path.isdir(shards):
        y = np.concatenate([c[1] for c in chunks(n)])
        write_shards(shards, (c[0] for c in chunks(n)), y)
    path = os.path.join(directory, "data.npz")
    if npz and not os.path.isfile(path):
        x = np.empty((n,) + SHAPE, np.uint8)
        y = np.empty(n, np.int32)
        for i, (cx, cy) in enumerate(chunks(n)):
            x[i * CHUNK:i * CHUNK + len(cx)], y[i * CHUNK:i * CHUNK + len(cy)] = cx, cy
        np.savez(path, x=x, y=y)
        del x


def tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of `pid`, RSS of pid and all its descendants), bytes."""
    def rss(p):
        try:
            with open(f"/proc/{p}/status") as f:
                return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024
        except (OSError, AttributeError):
            return 0

    def children(p):  # of every thread: Grain starts its workers from another one
        found = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    found += [int(c) for c in f.read().split()]
        except OSError:
            pass
        return found

    todo, total = [pid], 0
    while todo:
        p = todo.pop()
        total += rss(p)
        todo.extend(children(p))
    return rss(pid), total


def train(data: str, steps: int, workers: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "dpax", "train", "--model", "cnn", "--data", data,
           "--devices", "8", "--steps", str(steps), "--batch-size", "128", "--optimizer",
           "adam", "--lr", "1e-3", "--log-every", "100", "--data-workers", str(workers),
           "--quiet", "--out", out, "--overwrite"]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0, 0]

    def sample():
        while p.poll() is None:
            main, tree = tree_rss(p.pid)
            peak[0], peak[1] = max(peak[0], main), max(peak[1], tree)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = p.communicate()[0]
    sampler.join()
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    speed = float(re.search(r"([\d.]+) steps/s", output).group(1))
    loss = re.search(r"eval loss ([\d.]+)", output).group(1)
    return {"steps_per_sec": speed, "rss": peak[0], "tree_rss": peak[1],
            "wall_s": time.monotonic() - t0, "eval_loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--examples", type=int, default=1_400_000)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true", help="skip the in-memory run")
    args = ap.parse_args()
    generate(args.dir, args.examples, npz=not args.no_memory)
    shards = os.path.join(args.dir, "shards")
    size = sum(os.path.getsize(os.path.join(shards, f)) for f in os.listdir(shards))
    runs = [("streamed, training thread", shards, 0),
            (f"streamed, {args.workers} Grain workers", shards, args.workers)]
    if not args.no_memory:
        runs.append(("in memory (.npz, uint8)", os.path.join(args.dir, "data.npz"), 0))
    print(f"dataset: {args.examples} uint8 {'x'.join(map(str, SHAPE))} images, "
          f"{size / 1e9:.2f} GB of ArrayRecord shards; cnn, 8 devices, batch 128, Adam, "
          f"{args.steps} steps")
    print("| input | steps/s | peak RSS, process | peak RSS, with workers | wall s | eval loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, (name, data, workers) in enumerate(runs):
        r = train(data, args.steps, workers, os.path.join(args.dir, "runs", str(i)))
        print(f"| {name} | {r['steps_per_sec']:.2f} | {r['rss'] / 2**30:.2f} GiB | "
              f"{r['tree_rss'] / 2**30:.2f} GiB | {r['wall_s']:.0f} | {r['eval_loss']} |",
              flush=True)


if __name__ == "__main__":
    main()
