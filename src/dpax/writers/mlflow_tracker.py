"""MLflow: the run's config as params, every logged row's metrics at its step,
its files as artifacts. By default a real local store, a SQLite database in
the run directory (`mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db`)."""

from __future__ import annotations

import os
import time
import urllib.parse

from dpax.errors import DpaxError
from dpax.writers import MetricWriter
from dpax.writers.trackers import Logged, flat_config, install_line, metrics, require, run_name

EXPERIMENT = "dpax"  # unless MLFLOW_EXPERIMENT_NAME says otherwise
MAX_PARAMS = 100  # per log_batch call (MLflow's limit)
# MLflow keeps these stores in a database through SQLAlchemy and migrates its
# schema with alembic; mlflow-skinny installs neither, and without SQLAlchemy
# MLflow does not even know the scheme.
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def default_uri(out: str) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{os.path.abspath(os.path.join(out, 'mlflow.db'))}"


def check_store(uri: str | None, out: str | None) -> None:
    """Refuse, before any work, a store MLflow could not open: for want of a
    module (mlflow itself, SQLAlchemy and alembic for an SQL store, the
    database's driver that SQLAlchemy's dialect for the URI imports), or one
    MLflow refuses (a file store, a URL of no SQL dialect).

    Args:
      uri: the store `tracker=mlflow:URI` names; None: MLFLOW_TRACKING_URI,
        else a SQLite database in `out`.
      out: the run directory.
    """
    who = f"`tracker=mlflow:{uri}`" if uri else "`tracker=mlflow`"
    store = "its SQL store" if uri else f"its SQL store {where_default(out)}"
    uri = uri or default_uri(out or ".")
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if not scheme.startswith(SQL_SCHEMES):  # as MLflow tells an SQL store; file:, http(s):
        require(["mlflow"], who, "mlflow")
        return check_file_store(uri, scheme, who)
    require(["mlflow", "sqlalchemy", "alembic"], who, "mlflow", f" for {store}")
    driver = missing_driver(uri, who)
    if driver == "sqlite3":
        raise DpaxError(f"{who} needs Python's sqlite3 for {store}, and this Python was "
                        "built without it; use a Python that has it, or another store")
    if driver is not None:
        raise DpaxError(f"{who} needs {driver}, SQLAlchemy's driver for {store}, which is "
                        f"not installed; {install_line([driver], None)}")


def check_file_store(uri: str, scheme: str, who: str) -> None:
    """MLflow 3 refuses a store of plain files (a path or file: URI) unless
    MLFLOW_ALLOW_FILE_STORE is set; it would do so after the run's first files."""
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if scheme in ("", "file") and not allowed:
        raise DpaxError(f"{who}: MLflow keeps no runs in a file store ({uri}) unless "
                        "MLFLOW_ALLOW_FILE_STORE=true; give an SQL store such as "
                        "sqlite:////absolute/path/mlflow.db, or set that variable")


def where_default(out: str | None) -> str:
    """The store dpax picks when the tracker names none, as the user set it."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return f"MLFLOW_TRACKING_URI={os.environ['MLFLOW_TRACKING_URI']}"
    return default_uri(out or ".")


def missing_driver(uri: str, who: str) -> str | None:
    """The module of the database driver that the SQL store `uri` needs and
    lacks, or None."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(uri).get_dialect().import_dbapi()
    except ArgumentError as e:  # also a dialect SQLAlchemy does not know
        raise DpaxError(f"{who}: {uri} is not a database URL SQLAlchemy reads ({e}); give "
                        "one such as sqlite:////absolute/path/mlflow.db") from None
    except ImportError as e:
        return e.name or str(e)
    return None


class MlflowTracker(MetricWriter):
    """One MLflow run per dpax run; a resumed dpax run continues it
    (`previous`: what `state()` returned when it started)."""

    def __init__(self, uri: str | None, out: str, config: dict, previous: dict | None):
        import logging

        from mlflow.tracking import MlflowClient

        # MLflow logs its database migrations at INFO on first use: not the user's business.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        uri = previous["uri"] if previous else (uri or default_uri(out))
        self._pending = []  # rows queued for MLflow's logging thread
        self.uri, self._client = uri, MlflowClient(tracking_uri=uri)
        if previous:
            self.run_id = previous["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
            self._logged = self._logged_so_far()
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a store dpax made itself keeps its artifacts beside it
            local = uri.startswith("sqlite:///") and not os.environ.get("MLFLOW_TRACKING_URI")
            location = (f"file://{os.path.abspath(os.path.join(out, 'mlartifacts'))}"
                        if local else None)
            experiment_id = self._client.create_experiment(name, artifact_location=location)
        self.run_id = self._client.create_run(
            experiment_id, run_name=run_name(out),
            tags={"dpax.out": os.path.abspath(out)}).info.run_id
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_config(config).items()]
        for i in range(0, len(params), MAX_PARAMS):
            self._client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS])
        self._logged = Logged()

    def _logged_so_far(self) -> Logged:
        """Every (step, metric) the run holds, read back from the store."""
        keys = self._client.get_run(self.run_id).data.metrics
        return Logged((m.step, key) for key in keys
                      for m in self._client.get_metric_history(self.run_id, key))

    def state(self) -> dict:
        return {"uri": self.uri, "run_id": self.run_id}

    def where(self) -> str:
        return f"MLflow run {self.run_id} in {self.uri}"

    def write(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        values = self._logged.fresh(step, metrics(row))
        if values:
            now = int(time.time() * 1000)
            # MLflow stores NaN as NaN and clamps infinities to the largest float.
            # Queued, in order, on MLflow's logging thread: a database write per row
            # would cost the training thread milliseconds (a crash loses only the
            # queue's tail, which a resumed run fills in from metrics.jsonl).
            self._pending.append(self._client.log_batch(self.run_id, metrics=[
                Metric(k, v, now, step) for k, v in values.items()], synchronous=False))

    def artifact(self, path: str) -> None:
        self._client.log_artifact(self.run_id, path)

    def finish(self, failed: bool) -> None:
        for operation in self._pending:
            operation.wait()
        self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    def close(self) -> None:
        self.finish(False)
