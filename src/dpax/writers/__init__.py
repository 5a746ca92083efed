"""Where log rows go: peers behind one small interface (as in clu's
metric_writers). `MultiWriter` fans a row out; only process 0 builds writers."""

from __future__ import annotations

import abc


class MetricWriter(abc.ABC):
    """One place log rows go. Every writer writes rows; the experiment
    trackers also keep the run's files (`artifact`) and mark a run that
    raised as failed (`finish`), which the others inherit as doing nothing
    and closing."""

    @abc.abstractmethod
    def write(self, step: int, row: dict) -> None:
        """One log row, at `step`."""

    def close(self) -> None:  # noqa: B027 (optional: a no-op unless overridden)
        """Release what the writer holds (files, threads); nothing by default."""

    def artifact(self, path: str) -> None:  # noqa: B027 (optional, as `close`)
        """A file of the run (its config, its plot), for writers that keep files."""

    def finish(self, failed: bool) -> None:
        """The run's end (`failed`: it raised); closes the writer by default."""
        self.close()


class MultiWriter(MetricWriter):
    """Fans one row out to several writers; a context manager that closes them."""

    def __init__(self, writers: list[MetricWriter]):
        self._writers = writers

    def __enter__(self) -> MultiWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)

    def write(self, step: int, row: dict) -> None:
        for w in self._writers:
            w.write(step, row)

    def artifact(self, path: str) -> None:
        for w in self._writers:
            w.artifact(path)

    def finish(self, failed: bool) -> None:
        """Finish every writer once (a second call does nothing); a tracker
        marks its run failed when the run raised."""
        writers, self._writers = self._writers, []
        for w in writers:
            w.finish(failed)

    def close(self, failed: bool = False) -> None:
        self.finish(failed)


def scalars(row: dict) -> dict[str, float]:
    """The plain numbers of a row (vector metrics and strings left out)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
