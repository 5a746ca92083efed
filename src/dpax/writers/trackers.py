"""What the experiment trackers (`--tracker mlflow[:URI]`, `--tracker wandb`;
one module each) share: the flag's grammar, the check that their library is
installed, and what a continued tracker run already holds.

A tracker is a metric writer that also takes the run's config and files
(`artifact`) and continues the same tracker run when a dpax run resumes. Their
libraries are optional extras (`pip install 'dpax[mlflow]'`), imported only
when asked for.
"""

from __future__ import annotations

import importlib.util
import json
import os

from dpax.errors import DpaxError
from dpax.writers import scalars

# name -> (module it needs, the extra that installs it)
KINDS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
STATE_FILE = "trackers.json"


def parse(spec: str | None) -> list[tuple[str, str | None]]:
    """`mlflow:sqlite:///x.db,wandb` -> [("mlflow", "sqlite:///x.db"), ("wandb", None)]."""
    out = []
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        kind, _, arg = item.strip().partition(":")
        if kind not in KINDS:
            raise DpaxError(f"`tracker={item}`: unknown tracker {kind!r}; give "
                            "mlflow, mlflow:URI or wandb")
        if kind == "wandb" and arg:
            raise DpaxError("`tracker=wandb` takes no argument; set WANDB_PROJECT or "
                            "WANDB_MODE in the environment")
        if any(k == kind for k, _ in out):
            raise DpaxError(f"`tracker={spec}` names {kind} twice")
        out.append((kind, arg or None))
    return out


def check_installed(spec: str | None) -> None:
    """Refuse, before any work, a tracker whose library is not installed."""
    for kind, _ in parse(spec):
        module, extra = KINDS[kind]
        if importlib.util.find_spec(module) is None:
            raise DpaxError(f"`--tracker {kind}` needs {module}, which is not installed; "
                            f"pip install 'dpax[{extra}]'")


def read_state(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save_state(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def run_name(out: str) -> str:
    """The tracker run's name: the run directory's name."""
    return os.path.basename(os.path.abspath(out))


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """`{"model": {"lr": 0.1}}` -> `{"model.lr": "0.1"}` (trackers' params are flat)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def metrics(row: dict) -> dict[str, float]:
    """A row's numbers as tracker metrics (the step is their x axis, not a metric)."""
    values = scalars(row)
    values.pop("step", None)
    return values


class Logged:
    """What a continued tracker run already holds, as (step, metric) pairs, so
    a resumed run logs each once: the steps between the last checkpoint and a
    crash are trained again with the same values, and the tracker keeps the
    first. Not a prefix of the run's rows in general (MLflow's queue commits
    batches out of order). `through`: every step up to it counts as held
    (what an online W&B run reports: its last step)."""

    def __init__(self, held=(), through: int = -1):
        self.held, self.through = frozenset(held), through

    def fresh(self, step: int, row: dict) -> dict:
        """The part of `row` the tracker does not hold. A resumed run logs each
        (step, metric) at most once itself: the fill-in from metrics.jsonl
        stops at the resumed step, training starts after it."""
        if step <= self.through:
            return {}
        return {k: v for k, v in row.items() if (step, k) not in self.held}
