"""Seconds from the start of `dpax train ARGS` to its first step's log line
(give `--log-every 1`), the process stopped there: what a run, a resume or
a restart waits before training, with the compilation cache warm or cold
(`--compile-cache`).

    python scripts/first_step_time.py --model mlp --steps 50 --log-every 1 --compile-cache none

benchmarks/README.md ("The compilation cache") keeps the measured rows.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time


def main() -> None:
    start = time.perf_counter()
    run = subprocess.Popen([sys.executable, "-m", "dpax", "train", *sys.argv[1:]],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in run.stdout:
        if re.match(r"step \d+/\d+ ", line):
            print(f"{time.perf_counter() - start:.1f}")
            break
    else:
        print("no step line: the run failed or logged nothing", file=sys.stderr)
    run.kill()
    run.wait()


if __name__ == "__main__":
    main()
