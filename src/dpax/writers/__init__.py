"""Where log rows go: peers behind one small interface (as in clu's
metric_writers). `MultiWriter` fans a row out; only process 0 builds writers."""

from __future__ import annotations

from typing import Protocol


class MetricWriter(Protocol):
    def write(self, step: int, row: dict) -> None: ...
    def close(self) -> None: ...


class MultiWriter:
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
        """A file of the run (its config, its plot) for the writers that keep
        files: the experiment trackers."""
        for w in self._writers:
            if hasattr(w, "artifact"):
                w.artifact(path)

    def close(self, failed: bool = False) -> None:
        """Close every writer once (a second call does nothing); a tracker
        marks its run failed when the run raised."""
        writers, self._writers = self._writers, []
        for w in writers:
            if hasattr(w, "finish"):
                w.finish(failed)
            else:
                w.close()


def scalars(row: dict) -> dict[str, float]:
    """The plain numbers of a row (vector metrics and strings left out)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
