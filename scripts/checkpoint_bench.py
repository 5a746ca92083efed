"""What a checkpoint's checksums cost: save and restore, with and without them.

Builds the job the flags name (as `dpax train` would), trains two steps so
that the optimizer's state is not all zeros, then in each repeat saves and
restores once with the checksums and once without (`checksums.write` and
`Checkpointer.damage` made no-ops), the order alternating between repeats.
Per save: the call training waits for (`Checkpointer.save`: the state copied
off the devices, the previous save waited for, the directories made), and
the background write until the step is committed (`wait_until_finished`),
which includes the checksums; the checksums' own time is timed too. Per
restore: `Trainer.restore` of that step with a new Checkpointer (the check
of every file, then Orbax's read). The files are in the page cache both times.

    python scripts/checkpoint_bench.py --repeats 7 -- --model gpt --data text \\
        --seq-len 64 --batch-size 32 --devices 2
    python scripts/checkpoint_bench.py --repeats 7 -- --model deep-mlp --devices 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import dpax
from dpax.cli.job import TrainConfig, build
from dpax.training import checksums
from dpax.training.checkpoint import Checkpointer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then dpax train flags")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    devices = int(flags[flags.index("--devices") + 1]) if "--devices" in flags else 8
    dpax.simulate_devices(devices)
    config = _config(flags)
    job = build(config)
    data = job.input(0)
    ds = job.ds
    job.trainer.fit(ds.x_train, ds.y_train, batch_size=config.batch_size, until_step=2,
                    seed=config.seed, log_every=2, batches=data)
    directory = args.dir or tempfile.mkdtemp(prefix="dpax-ckpt-bench-")
    writer = Checkpointer(directory, keep=2)  # one, as a run has
    times = {True: [], False: []}
    step = 2
    for r in range(2 * args.repeats + 2):  # the first pair warms up
        on = r % 4 in (0, 3)  # on, off, off, on: each follows each as often
        step += 1
        row = _one(job, data, writer, step, on)
        if r >= 2:
            times[on].append(row)
        print(f"checksums {'on ' if on else 'off'}: " + "  ".join(
            f"{k} {v:.3f}s" for k, v in row.items()), flush=True)
    size = _size(os.path.join(directory, str(step)))
    print(f"\n{' '.join(flags)}: checkpoint {size / 2**20:.1f} MiB, "
          f"median of {args.repeats} (s)")
    for on in (False, True):
        med = {k: statistics.median(r[k] for r in times[on]) for k in times[on][0]}
        print(f"checksums {'on ' if on else 'off'}: " + "  ".join(
            f"{k} {v:.3f}" for k, v in med.items()))
    writer.close()
    if args.dir is None:
        shutil.rmtree(directory)


def _config(flags: list[str]) -> TrainConfig:
    pairs, i = {}, 0
    while i < len(flags):
        name = flags[i].lstrip("-").replace("-", "_")
        pairs[name] = flags[i + 1]
        i += 2
    typed = {k: int(v) if v.isdigit() else v for k, v in pairs.items()}
    return TrainConfig.from_flags(steps=1000, **typed)


def _one(job, data, ckpt: Checkpointer, step: int, on: bool) -> dict[str, float]:
    spent = {"checksums": 0.0}
    write = checksums.write

    def timed_write(step_dir):
        t0 = time.perf_counter()
        write(step_dir)
        spent["checksums"] += time.perf_counter() - t0

    with _patched(checksums, "write", timed_write if on else lambda d: None):
        t0 = time.perf_counter()
        ckpt.save(step, job.trainer.state_dict(), data, job.meta())
        t1 = time.perf_counter()
        ckpt.manager.wait_until_finished()
        t2 = time.perf_counter()
    reader = Checkpointer(ckpt.directory)
    damage = Checkpointer.damage

    def timed_damage(self, s):
        t0 = time.perf_counter()
        found = damage(self, s)
        spent["check"] += time.perf_counter() - t0
        return found

    spent["check"] = 0.0
    with _patched(Checkpointer, "damage", timed_damage if on else lambda self, s: None):
        t3 = time.perf_counter()
        job.trainer.restore(reader, step=step)
        t4 = time.perf_counter()
    reader.close()
    return {"save_call": t1 - t0, "background": t2 - t1, "checksums": spent["checksums"],
            "restore": t4 - t3, "check": spent["check"]}


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


if __name__ == "__main__":
    main()
