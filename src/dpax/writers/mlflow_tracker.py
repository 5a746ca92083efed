"""MLflow: the run's config as params, every logged row's metrics at its step,
its files as artifacts. By default a real local store, a SQLite database in
the run directory (`mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db`)."""

from __future__ import annotations

import os
import time

from dpax.writers.trackers import Logged, flat_config, metrics, run_name

EXPERIMENT = "dpax"  # unless MLFLOW_EXPERIMENT_NAME says otherwise
MAX_PARAMS = 100  # per log_batch call (MLflow's limit)


def default_uri(out: str) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{os.path.abspath(os.path.join(out, 'mlflow.db'))}"


class MlflowTracker:
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
