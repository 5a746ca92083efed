"""Metric writers (`dpax.writers`): one interface; `MultiWriter` fans rows, files
and the run's end out to every writer, whatever each one keeps."""

import contextlib

import pytest

from dpax.writers import MetricWriter, MultiWriter
from dpax.writers.console import LineWriter, ProgressBar
from dpax.writers.csv_file import CsvWriter
from dpax.writers.jsonl import JsonlWriter
from dpax.writers.mlflow_tracker import MlflowTracker
from dpax.writers.tensorboard import TensorBoardWriter
from dpax.writers.wandb_tracker import WandbTracker


class Plain(MetricWriter):
    """Writes rows and nothing else: files and the run's end are no-ops."""

    def __init__(self):
        self.rows, self.closed = [], 0

    def write(self, step, row):
        self.rows.append((step, row))

    def close(self):
        self.closed += 1


class Tracker(Plain):
    """Keeps files and marks a failed run, as the experiment trackers do."""

    def __init__(self):
        super().__init__()
        self.files, self.finished = [], []

    def artifact(self, path):
        self.files.append(path)

    def finish(self, failed):
        self.finished.append(failed)


@pytest.mark.parametrize("raised", [False, True])
def test_multiwriter_fans_out_rows_files_and_the_end_of_the_run(raised):
    plain, tracker = Plain(), Tracker()
    with pytest.raises(RuntimeError) if raised else contextlib.nullcontext():
        with MultiWriter([plain, tracker]) as out:
            out.write(3, {"loss": 1.0})
            out.artifact("config.yaml")
            if raised:
                raise RuntimeError
    assert plain.rows == tracker.rows == [(3, {"loss": 1.0})]
    assert tracker.files == ["config.yaml"] and tracker.finished == [raised]
    assert plain.closed == 1 and tracker.closed == 0  # a plain writer's end is its close
    out.close()  # a second close does nothing
    assert plain.closed == 1 and tracker.finished == [raised]


def test_every_writer_is_a_metric_writer():
    for cls in (LineWriter, ProgressBar, CsvWriter, JsonlWriter, TensorBoardWriter,
                MlflowTracker, WandbTracker, MultiWriter):
        assert issubclass(cls, MetricWriter), cls
    with pytest.raises(TypeError):  # `write` is the one method a writer must define
        type("NoWrite", (MetricWriter,), {})()

