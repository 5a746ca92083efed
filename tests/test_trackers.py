"""Experiment trackers, read back through their own libraries: MLflow's client
on the SQLite store, W&B's offline run files through `wandb leet inspect`.
What they hold must be metrics.jsonl, row for row, also after kill -9 and
--resume."""

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import yaml

from dpax.cli import main
from dpax.cli.outputs import check_trackers, open_trackers
from dpax.errors import DpaxError
from dpax.writers import trackers, wandb_tracker

TIMING = {"steps_per_sec"}  # differs between the killed attempt and the resumed one


@pytest.fixture(autouse=True)
def default_stores(monkeypatch):
    """The stores dpax picks itself (conftest keeps W&B offline)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def logged_by_step(out) -> dict[int, dict]:
    """metrics.jsonl's rows merged per step (a step's train and eval rows)."""
    merged = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        row = json.loads(line)
        merged.setdefault(row.pop("step"), {}).update(
            {k: v for k, v in row.items() if isinstance(v, (int, float))})
    return merged


def mlflow_by_step(out) -> tuple[dict[int, dict], object]:
    from mlflow.tracking import MlflowClient

    state = json.load(open(os.path.join(out, "trackers.json")))["mlflow"]
    client = MlflowClient(tracking_uri=state["uri"])
    run = client.get_run(state["run_id"])
    merged, seen = {}, set()
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            assert (m.step, key) not in seen, f"{key} logged twice at step {m.step}"
            seen.add((m.step, key))
            merged.setdefault(m.step, {})[key] = m.value
    return merged, (client, run)


def wandb_records(out) -> list[dict]:
    """Every record of every offline W&B run file in `out`, by W&B's own reader."""
    records = []
    for run_dir in sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*"))):
        text = subprocess.run([os.path.join(os.path.dirname(sys.executable), "wandb"), "leet",
                               "inspect", "--json", run_dir], capture_output=True, text=True,
                              check=True).stdout
        records += [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    return records


def wandb_by_step(records) -> dict[int, dict]:
    merged = {}
    for r in records:
        if r["type"] == "history":
            item = {k: float(v) if isinstance(v, str) else v  # "NaN", "Infinity"
                    for k, v in r["history"]["item"].items() if not k.startswith("_")}
            step = r["history"]["step"]["num"]
            assert not set(item) & set(merged.get(step, {})), f"step {step} logged twice"
            merged.setdefault(step, {}).update(item)
    return merged


def same(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        assert set(a[step]) == set(b[step]), step
        for key in a[step]:
            if key not in TIMING:
                x, y = a[step][key], b[step][key]
                assert x == y or (math.isnan(x) and math.isnan(y)), (step, key, x, y)


FLAGS = ["--model", "mlp", "--devices", "4", "--steps", "200", "--batch-size", "61",
         "--log-every", "5", "--eval-every", "50", "--tracker", "mlflow", "--tracker", "wandb"]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Killed with -9 just after its checkpoint of step 80, then resumed from
    it: the steps trained twice are logged once by the trackers, and what the
    kill kept from them (W&B flushes its file every 15 s) is filled in."""
    from test_checkpoint import wait_for

    base = tmp_path_factory.mktemp("trackers")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out, ck = str(base / "run"), str(base / "ck")
    args = [*FLAGS, "--out", out, "--checkpoint-dir", ck, "--checkpoint-every", "40"]
    p = subprocess.Popen([sys.executable, "-m", "dpax", "train", *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(os.path.join(ck, "80"), p)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    before = mlflow_by_step(out)[0]
    kept = wandb_by_step(wandb_records(out))
    span = f"{min(before)}..{max(before)}" if before else "none"
    print(f"killed after the checkpoint of step 80: MLflow held steps {span}, "
          f"W&B's offline file {len(kept)} steps")
    r = subprocess.run([sys.executable, "-m", "dpax", "train", *args, "--resume"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, before


@pytest.mark.slow  # starts dpax processes
@pytest.mark.processes  # starts dpax processes
def test_mlflow_holds_every_row_once_after_kill_and_resume(killed_and_resumed):
    out, before = killed_and_resumed
    assert before  # the killed attempt had logged rows: the resumed one continued its run
    held, (client, run) = mlflow_by_step(out)
    logged = logged_by_step(out)
    same(held, logged)
    assert {50, 100, 150, 200} <= {s for s, row in held.items() if "eval_loss" in row}
    print(f"MLflow: {len(held)} steps, {sum(map(len, held.values()))} values = metrics.jsonl")
    # The config as params, the run's files as artifacts, its name from --out.
    config = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert run.data.params == trackers.flat_config(config)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml",
                                                                         "metrics.png"}
    assert len(client.search_runs([run.info.experiment_id])) == 1  # resumed: the same run


@pytest.mark.slow
@pytest.mark.processes  # starts dpax processes
def test_wandb_offline_files_hold_every_row_once_after_kill_and_resume(killed_and_resumed):
    out, _ = killed_and_resumed
    records = wandb_records(out)
    # Two attempts (the killed one's file holds what W&B flushed before -9), one run id.
    assert len(glob.glob(os.path.join(out, "wandb", "offline-run-*"))) == 2
    runs = [r["run"] for r in records if r["type"] == "run"]
    assert runs and len({r["run_id"] for r in runs}) == 1
    assert all(r["display_name"] == "run" for r in runs)
    same(wandb_by_step(records), logged_by_step(out))
    config = runs[0]["config"]["update"]
    assert config["model"] == yaml.safe_load(open(os.path.join(out, "config.yaml")))["model"]
    files = {c["path"] for r in records if r["type"] == "artifact"
             for c in r["artifact"]["manifest"]["contents"]}
    assert files == {"config.yaml", "metrics.png"}


@pytest.mark.slow
def test_non_finite_metrics_reach_both_trackers(tmp_path):
    out = str(tmp_path / "nan")
    os.makedirs(out)
    rows = {1: {"loss": float("nan"), "lr": 0.1}, 2: {"loss": float("inf"), "lr": 0.1},
            3: {"loss": 1.5, "grad_norm": float("-inf")}}
    opened = open_trackers("mlflow,wandb", out, {"model": {"name": "mlp"}},
                           continue_run=False)
    for step, row in rows.items():
        for t in opened:
            t.write(step, row)
    for t in opened:
        t.close()
    held = mlflow_by_step(out)[0]
    assert math.isnan(held[1]["loss"]) and held[3]["loss"] == 1.5
    assert held[2]["loss"] > 1e308 and held[3]["grad_norm"] < -1e308  # MLflow clamps infinities
    seen = wandb_by_step(wandb_records(out))
    assert math.isnan(seen[1]["loss"]) and seen[2]["loss"] == math.inf
    assert seen[3] == {"loss": 1.5, "grad_norm": -math.inf}


def test_tracker_flags_are_checked_before_any_work(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "x")
    assert main(["train", "--tracker", "neptune", "--out", out]) == 2
    assert "unknown tracker 'neptune'" in capsys.readouterr().err
    assert main(["train", "--tracker", "mlflow"]) == 2
    assert "--tracker needs --out" in capsys.readouterr().err
    monkeypatch.setenv("HOME", str(tmp_path))  # W&B unset: neither mode nor key nor login
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert wandb_tracker.offline()
    monkeypatch.setenv("WANDB_MODE", "online")
    assert not wandb_tracker.offline()
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(DpaxError, match=r"pip install wandb==[0-9.]+, or pip install -e "
                                        r"'\.\[wandb\]' in dpax's checkout$"):
        check_trackers("mlflow,wandb", out)
    assert main(["train", "--tracker", "wandb", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tracker wandb needs wandb" in err
    assert not os.path.exists(out)  # refused before anything was written


@pytest.mark.parametrize("missing, store, message", [
    (["sqlalchemy", "alembic"], None, r"needs SQLAlchemy and alembic for its SQL store "
     r"sqlite:///\S+/run/mlflow.db, which are not installed; pip install SQLAlchemy==[0-9.]+ "
     r"alembic==[0-9.]+, or pip install -e '\.\[mlflow\]' in dpax's checkout$"),
    (["alembic"], "sqlite:///{tmp}/one.db", r"needs alembic for its SQL store, which is "
     r"not installed; pip install alembic=="),
    (["mlflow", "sqlalchemy", "alembic"], "sqlite:///{tmp}/one.db",
     r"needs mlflow-skinny, SQLAlchemy and alembic for its SQL store"),
    (["mlflow"], "http://localhost:5000", r"needs mlflow-skinny, "
     r"which is not installed; pip install mlflow-skinny=="),
    (["sqlite3"], None, r"needs Python's sqlite3 for its SQL store"),
    (["psycopg2"], "postgresql://user@host/db", r"needs psycopg2, SQLAlchemy's driver for its "
     r"SQL store, which is not installed; pip install psycopg2$"),
    ([], "file://{tmp}/mlruns", r"MLFLOW_ALLOW_FILE_STORE=true"),
    ([], "postgresqlx://host/db", r"is not a database URL SQLAlchemy reads"),
], ids=["sqlite-default", "no-alembic", "no-mlflow", "http", "no-sqlite3", "no-driver",
        "file-store", "bad-url"])
def test_a_tracker_that_could_not_open_its_store_is_refused_before_any_work(
        missing, store, message, tmp_path, monkeypatch, capsys):
    """What MLflow's store needs, checked before the first file is written: MLflow
    itself, SQLAlchemy and alembic for an SQL store (mlflow-skinny has neither),
    the database's driver, MLFLOW_ALLOW_FILE_STORE for a file store. Each is one
    line naming what to install, through the CLI (exit 2) and `dpax.cli.train.train`."""
    from dpax.cli.train import TrainConfig, train

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # find_spec: None; import fails
    out = str(tmp_path / "run")
    spec = "mlflow" if store is None else "mlflow:" + store.format(tmp=tmp_path)
    assert main(["train", "--model", "mlp", "--steps", "1", "--tracker", spec,
                 "--out", out]) == 2
    err = capsys.readouterr().err.removesuffix("\n")
    assert "\n" not in err and err.startswith(f"dpax: error: --tracker {spec}")
    assert re.search(message, err), err
    with pytest.raises(DpaxError, match=message) as refused:
        train(TrainConfig.from_flags(model="mlp", steps=1, tracker=spec, out=out))
    assert str(refused.value).startswith(f"`tracker={spec}`")
    assert os.listdir(tmp_path) == []  # nothing written: no run directory, no store


@pytest.mark.slow
def test_a_resumed_run_fills_in_what_the_trackers_lack_and_repeats_nothing(tmp_path):
    """Tracker runs that hold steps 1..5 but 2 (lost: MLflow's queue commits out
    of order) of a run resumed at step 3 (jsonl kept to 3): the trackers take 2
    from the jsonl, skip the replayed 4..5 and take 6..7. Tracker runs that
    hold nothing (a crash before W&B's first flush): they take 1..3 from the jsonl."""
    from dpax.writers.jsonl import JsonlWriter

    rows = {s: {"loss": 1.0 / s, "lr": 0.1} for s in range(1, 8)}
    for held in (5, 0):
        out = str(tmp_path / f"held{held}")
        os.makedirs(out)
        first = open_trackers("mlflow,wandb", out, {"seed": 0}, continue_run=False)
        for t in first:
            for s in range(1, held + 1):
                if s != 2:
                    t.write(s, rows[s])
            t.close()
        jsonl = JsonlWriter(os.path.join(out, "metrics.jsonl"))
        for s in range(1, 4):
            jsonl.write(s, rows[s])
        jsonl.close()
        resumed = open_trackers("mlflow,wandb", out, {"seed": 0}, continue_run=True)
        for t in resumed:
            for s in range(4, 8):
                t.write(s, rows[s])
            t.close()
        assert mlflow_by_step(out)[0] == rows  # each step once (checked while read)
        assert wandb_by_step(wandb_records(out)) == rows
