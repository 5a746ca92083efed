"""Several processes on JAX's own runtime (gloo on CPU) give one device's result."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dpax
from dpax.cli import main
from dpax.cli.launch import free_port
from dpax.cli.train import TrainConfig
from dpax.data.pipeline import BatchPlan
from test_gpt import write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # starts dpax processes or trains long

RUN = ["--steps", "10", "--batch-size", "50", "--optimizer", "sgd", "--lr", "0.1",
       "--log-every", "5"]


def launch(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dpax", "launch", *args], capture_output=True,
                          text=True, timeout=300, **kw)


def in_process(devices, out):
    assert main(["train", *RUN, "--devices", str(devices), "--out", str(out)]) == 0
    with np.load(out / "params.npz") as p:
        return {k: p[k] for k in p.files}


def test_launch_2x2_equals_1x4_equals_1x1_and_its_checkpoint_resumes_on_2(tmp_path, capsys):
    """The launched run keeps its examples on the devices (each process places
    them, the index batches split over both) and its Adam state fully sharded
    over both processes; the in-process ones, and the resume of its step-5
    checkpoint (one logical copy) replicated in one process on 2 devices,
    make host batches; it resumes fully sharded on 2 processes of 1 device too."""
    run = [*RUN, "--optimizer", "adam", "--lr", "0.01"]  # the later --optimizer wins
    ck = str(tmp_path / "ck")
    r = launch("--nprocs", "2", "--devices-per-process", "2", "--", *run, "--data-on-device",
               "--sharding", "full", "--checkpoint-dir", ck, "--checkpoint-every", "5",
               "--out", str(tmp_path / "launched"), "--tracker", "mlflow")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(re.findall(r"^\[rank 0\] eval accuracy", r.stdout, re.M)) == 1
    assert "[rank 1]" not in r.stdout  # only rank 0 reports, unless --verbose
    assert sorted(os.listdir(tmp_path / "launched")) == [
        "config.yaml", "metrics.csv", "metrics.jsonl", "metrics.png", "mlartifacts",
        "mlflow.db", "params.npz", "run.json", "trackers.json"]
    # Process 0 alone logs to the tracker: one run, each step once, as metrics.jsonl.
    from test_trackers import logged_by_step, mlflow_by_step

    held, (client, mlrun) = mlflow_by_step(str(tmp_path / "launched"))
    assert len(client.search_runs([mlrun.info.experiment_id])) == 1
    assert held == logged_by_step(str(tmp_path / "launched"))
    info = json.loads((tmp_path / "launched" / "run.json").read_text())
    assert (info["processes"], info["devices"]) == (2, 4)
    launched = dict(np.load(tmp_path / "launched" / "params.npz"))
    refs = {}
    for name, devices in (("four", 4), ("one", 1)):
        assert main(["train", *run, "--devices", str(devices), "--out", str(tmp_path / name)]) == 0
        refs[name] = dict(np.load(tmp_path / name / "params.npz"))
    assert main(["train", *run, "--devices", "2", "--resume", f"{ck}/5",
                 "--out", str(tmp_path / "resumed")]) == 0
    refs["resumed"] = dict(np.load(tmp_path / "resumed" / "params.npz"))
    # Resumed by 2 processes of 1 device, still fully sharded: each reads its
    # own halves of the split leaves straight onto its device. Step 10 has a
    # flipped byte in a file whose checksum process 1 checks, not process 0:
    # both fall back to step 5, and process 0 alone says so.
    files = dpax.training.checksums.read_manifest(f"{ck}/10")
    names = sorted(files)
    theirs = names[dpax.training.checksums.share(names, files, 1, 2)[0]]
    with open(os.path.join(ck, "10", theirs), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    r = launch("--nprocs", "2", "--devices-per-process", "1", "--", *run, "--sharding", "full",
               "--resume", ck, "--out", str(tmp_path / "relaunched"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed at step 5" in r.stdout
    warned = re.findall(r"^.*warning: checkpoint step 10 .*$", r.stdout + r.stderr, re.M)
    assert len(warned) == 1 and theirs in warned[0] and "[rank 0]" in warned[0], warned
    refs["resumed by 2 x 1"] = dict(np.load(tmp_path / "relaunched" / "params.npz"))
    capsys.readouterr()
    for name, ref in refs.items():
        diff = max(float(np.max(np.abs(launched[k] - ref[k]))) for k in ref)
        print(f"launched 2x2, fully sharded, vs {name}: max |diff| {diff:.2e}")
        assert diff <= 1e-5


def test_launch_2x2_in_a_group_per_process_equals_one_device(tmp_path):
    """Hybrid sharding as multi-host users run it (`--replicas processes`):
    Adam's state split over each process's 2 devices, replicated across the
    2 processes, a batch of 50 padded to 52; the same params as one device."""
    run = [*RUN, "--optimizer", "adam", "--lr", "0.01"]
    r = launch("--nprocs", "2", "--devices-per-process", "2", "--", *run, "--sharding", "full",
               "--replicas", "processes", "--out", str(tmp_path / "launched"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--sharding full in 2 replica groups" in r.stdout
    info = json.loads((tmp_path / "launched" / "run.json").read_text())
    assert (info["processes"], info["devices"], info["replica_groups"]) == (2, 4, 2)
    assert main(["train", *run, "--devices", "1", "--out", str(tmp_path / "one")]) == 0
    with np.load(tmp_path / "launched" / "params.npz") as a, \
            np.load(tmp_path / "one" / "params.npz") as b:
        diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in b.files)
    print(f"launched 2x2 in a group per process vs one device: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def _children(ppid):
    """{pid: command line} of the live processes whose parent is `ppid` (from /proc)."""
    kids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmd = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, ...
        if int(fields[1]) == ppid and fields[0] != "Z":
            kids[int(entry)] = cmd
    return kids


def test_killing_a_rank_stops_the_launch_and_leaves_no_process(tmp_path):
    cmd = [sys.executable, "-m", "dpax", "launch", "--nprocs", "2", "--devices-per-process",
           "2", "--", "--steps", "100000", "--batch-size", "50", "--log-every", "20"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:  # wait until training runs on both ranks
        lines.append(line)
        if "step 20/" in line:
            break
    ranks = _children(p.pid)
    victim = next(pid for pid, args in ranks.items() if "--process-id 1" in args)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    lines += p.stdout.readlines()
    rc = p.wait(timeout=60)
    took = time.monotonic() - t0
    out = "".join(lines)
    assert rc != 0 and took < 60
    assert "dpax launch: rank 1 was killed by SIGKILL" in out, out[-2000:]
    assert not _children(p.pid), "ranks still running after the launcher exited"
    for pid in ranks:  # reparented ranks would no longer show as children: check each
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read()


def test_bad_rows_in_one_processs_part_of_the_first_batch_stop_every_process(tmp_path):
    """A NaN among process 1's rows of the first (shuffled) batch, none of
    them rows `Trainer.check` reads: each process checks only its own rows,
    so they agree before the first step. Process 1 names the NaN, process 0
    says where it was found; both exit 2 with one line, neither waiting on
    the other (it waited in the step's all-reduce until --timeout)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, batch, path = 40, 8, str(tmp_path / "data.parquet")

    def write(x):
        pq.write_table(pa.table({"x": pa.array(list(x)), "y": pa.array(np.arange(n) % 2)}),
                       path)

    write(np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, 1))  # each row holds its index
    ds = dpax.data.datasets.load(path)
    first = BatchPlan(len(ds.y_train), batch, seed=0).indices(0)
    theirs = [i for i in first[batch // 2:] if i >= batch]  # not among check's rows 0..7
    assert theirs, first
    x = np.ones((n, 3), np.float32)
    x[int(ds.x_train[np.array(theirs[:1])][0, 0]), 1] = np.nan
    write(x)
    cmd = [sys.executable, "-m", "dpax", "train", "--model", "mlp", "--data", path,
           "--batch-size", str(batch), "--steps", "2", "--devices", "1", "--timeout", "60",
           "--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    t0 = time.monotonic()
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [p.communicate(timeout=50)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - t0
    lines = [[line for line in err.splitlines() if "[Gloo]" not in line] for err in errs]
    assert [p.returncode for p in procs] == [2, 2], lines
    assert lines == [
        ["dpax: error: process 1 found bad examples in its rows of the first batch of --data "
         "(each process checks its own); its error names them and the fix"],
        ["dpax: error: the first batch of --data contains NaN or infinite values in 1 of its "
         "4 examples (the first at row 0); clean the data first"]], lines
    print(f"both processes refused the first batch in {took:.1f}s")

@pytest.mark.parametrize("flags,needle", [
    (["--coordinator", "no-port-here", "--num-processes", "2", "--process-id", "0"],
     "not HOST:PORT"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, 2)"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "-1"],
     "--process-id must be in [0, 2)"),
    (["--coordinator", "nosuchhost.invalid:1234", "--num-processes", "2",
      "--process-id", "1"], "does not resolve"),
    (["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1",
      "--init-timeout", "2"], "cannot reach the coordinator"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0",
      "--backend", "pmap"], "use --backend shard_map"),
    (["--num-processes", "2"], "together"),
])
def test_bad_multiprocess_flags_exit_2_with_one_line(flags, needle, capsys):
    assert main(["train", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_launch_refuses_flags_it_sets_itself():
    r = launch("--nprocs", "2", "--", "--process-id", "1")
    assert r.returncode == 2 and "sets --process-id itself" in r.stderr


def test_a_launch_into_a_used_out_stops_at_once_with_one_line(tmp_path):
    """The launcher refuses the --out before any rank starts: a rank that
    joined the run waited at exit for its peers, 30 s, then a traceback."""
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # what a run leaves
    t0 = time.monotonic()
    r = launch("--nprocs", "2", "--devices-per-process", "2", "--", "--steps", "5",
               "--out", str(tmp_path))
    took = time.monotonic() - t0
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stderr.startswith("dpax: error: --out") and "already holds a run" in r.stderr
    assert "[rank" not in r.stdout + r.stderr  # no rank started
    assert took < 25, took  # no rank waits out the runtime's 30 s
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"  # nothing overwritten


def test_pmap_with_several_processes_names_the_fix():
    with pytest.raises(dpax.DpaxError, match="`backend=shard_map`"):
        dpax.config.validate(TrainConfig.from_flags(
            backend="pmap", num_processes=2, process_id=0, coordinator="localhost:1"))


def test_launched_batchnorm_and_dropout_model_equals_one_process(tmp_path, capsys, seed=0):
    """SyncBatchNorm statistics and dropout keys span processes too, with the bits
    of one process: seed 0 has a max-pool near-tie at step 3 that the gloo
    all-reduce's own order used to flip (1.1e-3). (One seed: the bits are the
    same by construction, `test_two_processes_sum_in_rank_order_like_one`;
    test_batchnorm_dropout.py runs several seeds in one process.)"""
    flags = ["--model", "cnn-bn", "--steps", "5", "--batch-size", "50", "--optimizer", "sgd",
             "--lr", "0.05", "--log-every", "5", "--seed", str(seed)]
    r = launch("--nprocs", "2", "--devices-per-process", "2", "--", *flags,
               "--out", str(tmp_path / "launched"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert main(["train", *flags, "--devices", "4", "--out", str(tmp_path / "four")]) == 0
    capsys.readouterr()
    a, b = (dict(np.load(tmp_path / d / "params.npz")) for d in ("launched", "four"))
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    print(f"cnn-bn seed {seed} launched 2x2 vs 1x4: max |diff| {diff:.2e}")
    assert diff == 0.0  # the same sums in the same order: the same bits


def test_launched_streamed_augmented_run_equals_one_device(tmp_path, capsys):
    """ArrayRecord shards with crop+flip and an uneven batch (45): each of 2
    processes x 2 devices reads and augments only its rows, and the params are
    one device's."""
    from test_sources import images

    x, y = images(n=300)
    shards = str(tmp_path / "shards")
    dpax.data.prepare.write_shards(shards, [x], y, shard_bytes=64 * 192, progress=False)
    flags = ["--model", "cnn", "--data", shards, "--augment", "crop,flip", "--steps", "15",
             "--batch-size", "45", "--optimizer", "adam", "--lr", "0.001", "--log-every", "5"]
    r = launch("--nprocs", "2", "--devices-per-process", "2", "--", *flags,
               "--out", str(tmp_path / "launched"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert main(["train", *flags, "--devices", "1", "--out", str(tmp_path / "one")]) == 0
    assert main(["train", *flags[:4], *flags[6:], "--devices", "1",
                 "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    a, b, c = (dict(np.load(tmp_path / d / "params.npz")) for d in ("launched", "one", "plain"))
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    print(f"streamed + augmented, launched 2x2 vs 1 device: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    assert max(float(np.max(np.abs(b[k] - c[k]))) for k in b) > 1e-4  # it did augment


def test_launched_gpt_on_text_equals_one_device_and_the_cli_samples_it(tmp_path, capsys):
    """The GPT on padded short documents, an uneven batch (13), dropout and an
    EMA, its loss weighted by tokens: 2 processes x 2 devices give one device's
    params and EMA. The one-device run is the CLI's LM path: its metrics and
    `dpax sample` from its checkpoint."""
    corpus = write_corpus(tmp_path / "corpus")
    flags = ["--model", "gpt", "--data", f"text:{corpus}", "--seq-len", "16", "--layers", "2",
             "--width", "32", "--heads", "2", "--dropout", "0.1", "--ema-decay", "0.9",
             "--batch-size", "13", "--steps", "8", "--optimizer", "sgd", "--lr", "0.5",
             "--log-every", "4"]
    r = launch("--nprocs", "2", "--devices-per-process", "2", "--", *flags,
               "--out", str(tmp_path / "launched"))
    assert r.returncode == 0, r.stdout + r.stderr
    ck = str(tmp_path / "ck")
    assert main(["train", *flags, "--devices", "1", "--out", str(tmp_path / "one"),
                 "--checkpoint-dir", ck]) == 0
    # What an LM run logs, and sampling from its checkpoint.
    rows = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")]
    train, last = rows[0], rows[-1]
    assert train["tokens"] > 0 and train["tokens_per_sec"] > 0 and 0 < train["mfu"]
    assert math.isclose(train["bpb"], train["loss"] / math.log(2))
    assert math.isclose(last["eval_perplexity"], math.exp(last["eval_loss"]))
    capsys.readouterr()
    assert main(["sample", "--checkpoint", ck, "--prompt", "def ", "--tokens", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    a, b = (dict(np.load(tmp_path / d / "params.npz")) for d in ("launched", "one"))
    params = max(float(np.max(np.abs(a[k] - b[k]))) for k in b)
    # The final eval runs on the EMA params: it compares the EMAs.
    ev_a, ev_b = (final_eval(tmp_path / d) for d in ("launched", "one"))
    print(f"gpt launched 2x2 vs 1 device: params {params:.2e}, EMA eval loss "
          f"{ev_a:.6f} vs {ev_b:.6f}")
    assert params <= 1e-5 and abs(ev_a - ev_b) <= 1e-5


def final_eval(out):
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


RANK_ORDER_SCRIPT = """
import sys
import numpy as np
import dpax
from dpax.parallel import distributed
pid = int(sys.argv[1])
dpax.simulate_devices(2)
distributed.initialize(distributed.DistributedConfig(coordinator=sys.argv[2], num_processes=2,
                                                     process_id=pid))
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dpax import collectives
mesh = Mesh(np.array(jax.devices()), ("data",))
x = (np.random.default_rng(0).random((4, 129)) * 100).astype(np.float32)
g = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data")), lambda i: x[i])
f = lambda fn: jax.jit(jax.shard_map(lambda v: fn(v[0]), mesh=mesh, in_specs=P("data"),
                                     out_specs=P()))(g).addressable_data(0)
ours = np.asarray(f(lambda v: collectives.psum_tree({"v": v}, "data", pack=True)["v"]))
gloo = np.asarray(f(lambda v: jax.lax.psum(v, "data")))
rank_order = ((((np.zeros(129, np.float32) + x[0]) + x[1]) + x[2]) + x[3])
print("dpax", np.array_equal(ours, rank_order), "gloo", np.array_equal(gloo, rank_order))
"""


def test_two_processes_sum_in_rank_order_like_one(tmp_path):
    """Across processes dpax's sums are the rank-order sums one process makes."""
    script = tmp_path / "rank_order.py"
    script.write_text(RANK_ORDER_SCRIPT)
    address = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(i), address],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "dpax True" in out, out
    print("gloo's own psum in rank order:", "gloo True" in outs[0][0])


def test_the_launcher_says_why_after_the_failed_ranks_last_words():
    """A stalled rank prints its stacks and exits; the launcher's verdict must
    come after them in the launch's output, however late its pump is (the
    cluster test once read the verdict before the rank's own lines)."""
    import io
    import threading

    from dpax.cli import launch as launcher
    from dpax.cli.exits import EXIT_STALLED

    out = io.StringIO()
    code = f"print('stacks of the stalled rank', flush=True); raise SystemExit({EXIT_STALLED})"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, start_new_session=True),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)]  # as launched: a group each

    def late_pump(stream):
        time.sleep(1.0)  # a pump thread behind the process it reads
        launcher._pump(stream, 0, lambda line: True, out, launcher.Muted())

    pumps = [[threading.Thread(target=late_pump, args=(procs[0].stdout,), daemon=True)], []]
    pumps[0][0].start()
    assert launcher._wait(procs, out, pumps, launcher.Muted()) == EXIT_STALLED
    lines = out.getvalue().splitlines()
    assert lines == ["[rank 0] stacks of the stalled rank",
                     "dpax launch: rank 0 stalled (it waited on its peers longer than "
                     "--timeout); stopping the other ranks"], lines
    assert procs[1].wait(timeout=10) == -signal.SIGKILL


def test_after_a_rank_fails_the_others_output_is_not_shown():
    """A rank that loses its peer fails inside a collective and says so at
    length; once the launcher knows which rank failed first, only that rank's
    last words and the verdict show. The survivor's pump reads late, as a
    busy launcher's does: its lines arrive after the failure was seen."""
    import io
    import threading

    from dpax.cli import launch as launcher

    out, muted = io.StringIO(), launcher.Muted()
    survivor = ("import sys, time; print('Traceback: the peer went away', file=sys.stderr, "
                "flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", survivor], stderr=subprocess.PIPE,
                              text=True, start_new_session=True),
             subprocess.Popen([sys.executable, "-c", "import os, signal, time; time.sleep(1); "
                               "print('last words', flush=True); "
                               "os.kill(os.getpid(), signal.SIGKILL)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)]

    def pump(stream, rank, delay):
        time.sleep(delay)
        launcher._pump(stream, rank, lambda line: True, out, muted)

    pumps = [[threading.Thread(target=pump, args=(procs[0].stderr, 0, 3.0), daemon=True)],
             [threading.Thread(target=pump, args=(procs[1].stdout, 1, 0.0), daemon=True)]]
    for t in (pumps[0][0], pumps[1][0]):
        t.start()
    assert launcher._wait(procs, out, pumps, muted) == 128 + signal.SIGKILL
    pumps[0][0].join(timeout=10)
    lines = out.getvalue().splitlines()
    assert lines == ["[rank 1] last words",
                     "dpax launch: rank 1 was killed by SIGKILL; stopping the other ranks"], lines
    kept = muted.close()  # nothing lost: the survivor's lines are in its file
    assert open(os.path.join(kept, "rank0.log")).read() == "Traceback: the peer went away\n"


AGREE_SCRIPT = """
import os
import sys
import numpy as np
import dpax
from dpax.parallel import distributed
pid, ck = int(sys.argv[1]), sys.argv[3]
dpax.simulate_devices(1)
distributed.initialize(distributed.DistributedConfig(coordinator=sys.argv[2], num_processes=2,
                                                     process_id=pid))
import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dpax.errors import RunFailed
from dpax.training.checkpoint import Checkpointer
like = jax.ShapeDtypeStruct((4,), np.float32,
                            sharding=NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P()))
def state(value):
    return {"w": jax.make_array_from_callback((4,), like.sharding,
                                              lambda i: np.full(4, value, np.float32)[i])}
def restore(ckpt, what):
    step, flat, _ = ckpt.restore({"w": like}, None)
    print(what, step, float(np.asarray(flat["w"].addressable_data(0))[0]), flush=True)
ckpt = Checkpointer(ck)
for step in (10, 20, 30):
    ckpt.save(step, state(step), None, {})
ckpt.close()
# Process 1 lists the directory before another run commits step 30, process 0 after.
name_format = type(ocp.path.step.standard_name_format())
glob = name_format._glob_step_paths
if pid == 1:
    name_format._glob_step_paths = lambda self, base: [
        p for p in glob(self, base) if p.name != "30"]
restore(Checkpointer(ck), "listed")
name_format._glob_step_paths = glob
# Process 1 cannot read step 30's state, process 0 can: it matches its
# checksums, so both stop, and neither passes it over.
ckpt = Checkpointer(ck)
read = ckpt.manager.restore
def unreadable(step, args):
    if step == 30 and "state" in args:
        raise OSError("a shard of step 30 is unreadable here")
    return read(step, args=args)
if pid == 1:
    ckpt.manager.restore = unreadable
try:
    restore(ckpt, "unreadable")
except RunFailed as e:
    print("failed", str(e).split(" (")[0], flush=True)
# Bytes flipped in step 30's largest file: the process whose share holds it
# finds it, and both pass over the step.
if pid == 0:
    step_dir = os.path.join(ck, "30", "state")
    files = [os.path.join(r, n) for r, _, ns in os.walk(step_dir) for n in ns]
    with open(max(files, key=os.path.getsize), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        data = f.read(64)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))
distributed.any_process(False)  # process 1 waits for the flip
ckpt = Checkpointer(ck)
restore(ckpt, "damaged")
# Its first save: process 0 sets step 30 aside, then both save step 25.
ckpt.save(25, state(25), None, {})
ckpt.close()
print("steps", Checkpointer(ck).steps(), sorted(os.listdir(ck)), flush=True)
restore(Checkpointer(ck), "newest")
"""


def test_two_processes_restore_the_same_step_and_save_past_it_together(tmp_path):
    """Process 1 lists the steps without the newest (a run committed it in
    between): both restore process 0's newest step. Process 1 cannot read a
    step that matches its checksums: both stop, neither passing it over.
    Damage that one process's share of the checksums finds: both fall back
    past the step, and the first save sets it aside before either saves."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE_SCRIPT)
    address = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(i), address,
                               str(tmp_path / "ck")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:  # a pair whose collectives went astray may hang: no leftovers
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        said = [ln for ln in out.splitlines() if not ln.startswith("[Gloo]")]
        assert said == ["listed 30 30.0",
                        f"failed checkpoint step 30 in {tmp_path / 'ck'} could not be read",
                        "damaged 20 20.0",
                        "steps [10, 20, 25] ['10', '20', '25', '30.damaged']",
                        "newest 25 25.0"], (rank, out, err[-3000:])
    warned = [ln for ln in outs[0][1].splitlines() if "warning" in ln]
    assert len(warned) == 1 and warned[0].startswith(
        f"dpax: warning: checkpoint step 30 in {tmp_path / 'ck'} is damaged (state/"), warned
    assert warned[0].endswith("does not match its checksum); using step 20"), warned
