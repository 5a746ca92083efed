"""Issue 63's table: bad inputs and failures as a new user meets them, each
run in a fresh process, with its exit code, the first line it prints on
stderr and how many lines it prints there.

    python scripts/failure_table.py --src src --work /tmp/failures

`--src` is the dpax source tree to run (so an older checkout's `src` gives
the "before" column). The disk-full case needs root (a small tmpfs); without
it that row says so. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

PY = sys.executable
# Keeps what the Python cases print to one line they choose.
API = """
import sys, numpy as np, optax, dpax
dpax.simulate_devices(2)
ds = dpax.data.digits()
def trainer():
    m = dpax.make_model("mlp", ds.input_shape, ds.n_out, seed=0)
    return dpax.Trainer(m, dpax.classification_loss, optax.adam(1e-3), devices=2)
try:
{body}
except Exception as e:
    print(f"{{type(e).__name__}}: {{str(e).splitlines()[0] if str(e) else ''}}", file=sys.stderr)
    sys.exit(1)
"""


def run(argv, env, cwd, timeout=600, preexec=None):
    t0 = time.monotonic()
    p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       preexec_fn=preexec)
    return p, time.monotonic() - t0


def dpax(*args):
    return [PY, "-m", "dpax", *args]


def api(body: str):
    indented = "\n".join("    " + line for line in body.strip().splitlines())
    return [PY, "-c", API.format(body=indented)]


def first(text: str) -> str:
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return (lines[0][:140] if lines else "").replace("|", "\\|")


def count(text: str) -> int:
    return len([ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()])


def flip(path: str, n: int = 200) -> None:
    """`n` bytes inverted in the middle of the largest file under `path`."""
    files = [f for f in glob.glob(os.path.join(path, "**"), recursive=True) if os.path.isfile(f)]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        data = f.read(n)
        f.seek(os.path.getsize(big) // 2)
        f.write(bytes(255 - b for b in data))


def truncate(path: str) -> None:
    files = [f for f in glob.glob(os.path.join(path, "**"), recursive=True) if os.path.isfile(f)]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 2)


class Table:
    """The rows so far, and how to run a case in the source tree under test."""

    def __init__(self, src: str, work: str):
        self.work = work
        self.env = dict(os.environ, PYTHONPATH=os.path.abspath(src), PYTHONUNBUFFERED="1")
        self.rows = []

    def case(self, name, argv, check=None, env=None, **kw):
        p, took = run(argv, env or self.env, self.work, **kw)
        extra = check() if check else ""
        self.add(name, p.returncode, p.stderr, extra)
        print(f"{name}: {p.returncode} {first(p.stderr)[:80]} ({took:.0f}s)", file=sys.stderr)

    def add(self, name, rc, stderr, extra=""):
        self.rows.append((name, rc, first(stderr), count(stderr), extra))

    def setup(self, argv):
        run(argv, self.env, self.work)


BASE = ["--model", "mlp", "--devices", "2", "--batch-size", "64", "--log-every", "10", "--quiet"]


def helps(t: Table) -> None:
    t.case("dpax train --help", dpax("train", "--help"))
    t.case("dpax train -h", dpax("train", "-h"))
    t.case("dpax eval --help", dpax("eval", "--help"))


def checkpoints(t: Table) -> None:
    """A run with checkpoints at steps 10 and 20 to damage, and a GPT's."""
    work = t.work
    ck = os.path.join(work, "ck")
    t.setup(dpax("train", *BASE, "--steps", "20", "--checkpoint-dir", ck, "--checkpoint-every",
                 "10", "--out", os.path.join(work, "run")))
    gpt_ck = os.path.join(work, "gpt-ck")
    t.setup(dpax("train", "--model", "gpt", "--data", "text", "--seq-len", "16", "--layers",
                 "1", "--width", "32", "--heads", "2", "--batch-size", "8", "--steps", "2",
                 "--devices", "1", "--quiet", "--checkpoint-dir", gpt_ck))

    def damaged(name, how, steps=(20,)):
        d = os.path.join(work, name)
        shutil.copytree(ck, d)
        for s in steps:
            how(os.path.join(d, str(s)))
        return d

    t.case("eval: 200 bytes flipped in the newest step",
           dpax("eval", "--checkpoint", damaged("flipped", flip)))
    t.case("train --resume: 200 bytes flipped in the newest step",
           dpax("train", *BASE, "--steps", "30", "--checkpoint-dir", damaged("flipped2", flip),
                "--resume"))
    t.case("train --resume: a file of the newest step truncated",
           dpax("train", *BASE, "--steps", "30", "--checkpoint-dir", damaged("cut", truncate),
                "--resume"))
    t.case("eval: every step damaged",
           dpax("eval", "--checkpoint", damaged("all", flip, steps=(10, 20))))
    t.case("eval: the damaged step named",
           dpax("eval", "--checkpoint", os.path.join(damaged("named", flip), "20")))
    inputs = os.path.join(work, "inputs.npz")
    np.savez(inputs, x=np.zeros((5, 8, 8, 1), np.float32))
    t.case("predict: 200 bytes flipped in the newest step",
           dpax("predict", "--checkpoint", damaged("flipped3", flip), "--data", inputs,
                "--out", os.path.join(work, "p.npz")))
    gpt_bad = os.path.join(work, "gpt-bad")
    shutil.copytree(gpt_ck, gpt_bad)
    flip(os.path.join(gpt_bad, "2"))
    t.case("sample: 200 bytes flipped", dpax("sample", "--checkpoint", gpt_bad, "--tokens", "5"))
    t.case("export: 200 bytes flipped",
           dpax("export", "--checkpoint", gpt_bad, "--out", os.path.join(work, "hf-bad")))

    hf = os.path.join(work, "hf")
    os.makedirs(hf)
    with open(os.path.join(hf, "README.md"), "w") as f:
        f.write("the user's notes\n")

    def readme_kept():
        kept = os.path.exists(os.path.join(hf, "README.md"))
        modes = sorted({oct(os.stat(os.path.join(hf, n)).st_mode & 0o777)[2:]
                        for n in os.listdir(hf)})
        return f"README.md {'kept' if kept else 'deleted'}; modes {', '.join(modes)}"

    t.case("export --overwrite into a directory with the user's README.md",
           dpax("export", "--checkpoint", gpt_ck, "--out", hf, "--overwrite"), readme_kept)


def inputs(t: Table) -> None:
    """A tracker's store half installed; labels and inputs of an .npz."""
    work = t.work
    # sitecustomize makes `import sqlalchemy` (and alembic) fail.
    blocked = os.path.join(work, "no-sqlalchemy")
    os.makedirs(blocked)
    with open(os.path.join(blocked, "sitecustomize.py"), "w") as f:
        f.write("import sys\nsys.modules['sqlalchemy'] = None\nsys.modules['alembic'] = None\n")
    env = dict(t.env, PYTHONPATH=f"{blocked}:{t.env['PYTHONPATH']}")
    t.case("--tracker mlflow:sqlite:// without SQLAlchemy",
           dpax("train", *BASE, "--steps", "5", "--out", os.path.join(work, "mlf"),
                "--tracker", f"mlflow:sqlite:///{work}/m.db"), env=env)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype(np.float32)
    np.savez(os.path.join(work, "floaty.npz"), x=x, y=rng.integers(0, 4, 200).astype(np.float32))
    t.case("train: float labels 0..3 in an .npz",
           dpax("train", "--data", os.path.join(work, "floaty.npz"), "--model", "mlp",
                "--steps", "2", "--devices", "2", "--quiet"))
    bad_x = x.copy()
    bad_x[3, 2] = np.nan
    np.savez(os.path.join(work, "nan.npz"), x=bad_x, y=rng.integers(0, 4, 200))
    t.case("train: NaN in an .npz's x",
           dpax("train", "--data", os.path.join(work, "nan.npz"), "--steps", "2", "--quiet"))


def disk(t: Table) -> None:
    """The disk fills during a checkpoint (a 3 MiB tmpfs; needs root)."""
    full = os.path.join(t.work, "full")
    os.makedirs(full)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", full]).returncode == 0
    if not mounted:
        t.rows.append(("train: the disk fills during a checkpoint", "-", "needs root", "-", ""))
        return
    try:
        t.case("train: the disk fills during a checkpoint (deep-mlp)",
               dpax("train", "--model", "deep-mlp", "--devices", "2", "--steps", "30",
                    "--checkpoint-dir", os.path.join(full, "ck"), "--checkpoint-every", "5",
                    "--quiet", "--out", os.path.join(t.work, "full-run")),
               lambda: "left: " + (", ".join(sorted(os.listdir(os.path.join(full, "ck"))))
                                   or "nothing"))
    finally:
        subprocess.run(["umount", full])


def launch(t: Table) -> None:
    """A rank killed under dpax launch, after it trained 40 steps."""
    cmd = dpax("launch", "--nprocs", "2", "--devices-per-process", "2", "--", "--steps",
               "100000", "--batch-size", "50", "--log-every", "20", "--checkpoint-dir",
               os.path.join(t.work, "lk"), "--checkpoint-every", "20")
    p = subprocess.Popen(cmd, env=t.env, cwd=t.work, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "step 40/" in line:
            break
    ranks = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "--", "--process-id 1( |$)"],
                           capture_output=True, text=True)  # the launcher's rank 1 only
    for pid in ranks.stdout.split():
        os.kill(int(pid), signal.SIGKILL)
    after = p.stdout.readlines()
    t.add("launch: rank 1 killed (SIGKILL) at step 40", p.wait(), "".join(after),
          "lines after the kill")


def python_api(t: Table) -> None:
    for name, body in [
        ("fit(batch_size=0)", "trainer().fit(ds.x_train, ds.y_train, batch_size=0, epochs=1)"),
        ("fit: labels beyond the model's classes",
         "t = trainer(); t.fit(ds.x_train, ds.y_train + 20, batch_size=64, epochs=3)\n"
         "print('trained', t.step, 'steps', file=sys.stderr)"),
        ("fit: NaN in x", "x = ds.x_train.copy(); x[5] = np.nan\n"
         "t = trainer(); t.fit(x, ds.y_train, batch_size=64, epochs=1)\n"
         "print('trained', t.step, 'steps', file=sys.stderr)"),
        ("fit: float labels with classification_loss",
         "trainer().fit(ds.x_train, ds.y_train.astype(np.float32), batch_size=64, epochs=1)"),
        ("fit: one-hot labels with classification_loss",
         "trainer().fit(ds.x_train, np.eye(10)[ds.y_train], batch_size=64, epochs=1)"),
        ("fit: empty data", "trainer().fit(ds.x_train[:0], ds.y_train[:0], batch_size=64, "
                            "epochs=1)"),
        ("fit: x and y of different lengths",
         "trainer().fit(ds.x_train, ds.y_train[:-1], batch_size=64, epochs=1)"),
        ("evaluate(batch_size=0)", "trainer().evaluate(ds.x_eval, ds.y_eval, batch_size=0)"),
    ]:
        t.case("Python: " + name, api(body))


GROUPS = {"help": helps, "checkpoints": checkpoints, "inputs": inputs, "disk": disk,
          "launch": launch, "python": python_api}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="the dpax source tree to run")
    parser.add_argument("--work", default="/tmp/dpax-failures")
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help=f"which cases, of {', '.join(GROUPS)}")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    table = Table(args.src, work)
    for group in args.groups.split(","):
        GROUPS[group](table)
    print("| case | exit | stderr lines | first line | also |")
    print("| --- | --- | --- | --- | --- |")
    for name, rc, line, n, extra in table.rows:
        print(f"| {name} | {rc} | {n} | {line} | {extra} |")


if __name__ == "__main__":
    main()
