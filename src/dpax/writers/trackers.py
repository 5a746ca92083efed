"""What the experiment trackers (`tracker="mlflow[:URI]"`, `tracker="wandb"`;
one module each) share: the setting's grammar, the check that what they need is
installed, and what a continued tracker run already holds.

A tracker is a metric writer that also takes the run's config and files
(`artifact`) and continues the same tracker run when a dpax run resumes. Their
libraries are optional extras of dpax (`pip install -e '.[mlflow]'` in its
checkout), imported only when asked for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex

from dpax.errors import DpaxError
from dpax.writers import scalars

KINDS = ("mlflow", "wandb")  # each is also the name of the dpax extra that installs it
STATE_FILE = "trackers.json"
# What pip installs a module as, where the names differ (dpax's extras pin mlflow-skinny).
DISTRIBUTIONS = {"mlflow": "mlflow-skinny", "sqlalchemy": "SQLAlchemy", "MySQLdb": "mysqlclient"}


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


def require(modules: list[str], who: str, extra: str, why: str = "") -> None:
    """Raise the one-line error naming those of `modules` that are not installed
    and the pip line that installs them (`who` needs them `why`)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    names = [DISTRIBUTIONS.get(m, m) for m in missing]
    names = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    verb = "is" if len(missing) == 1 else "are"
    raise DpaxError(f"{who} needs {names}{why}, which {verb} not installed; "
                    f"{install_line(missing, extra)}")


def install_line(modules: list[str], extra: str | None) -> str:
    """`pip install` with the versions dpax pins, and the extra that has them
    (dpax is installed from its checkout: on no package index)."""
    line = "pip install " + " ".join(shlex.quote(pinned(DISTRIBUTIONS.get(m, m)))
                                     for m in modules)
    return f"{line}, or pip install -e '.[{extra}]' in dpax's checkout" if extra else line


def pinned(distribution: str) -> str:
    """`distribution` as dpax's metadata pins it (`SQLAlchemy==2.0.58`), or
    bare where dpax pins it nowhere or runs uninstalled (from a source tree)."""
    try:
        requirements = importlib.metadata.requires("dpax") or []
    except importlib.metadata.PackageNotFoundError:
        return distribution
    for requirement in requirements:
        spec = requirement.partition(";")[0].strip()
        name = re.match(r"[A-Za-z0-9._-]*", spec).group(0)
        if _normal(name) == _normal(distribution) and spec != name:
            return spec
    return distribution


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503's name comparison


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
