"""TensorBoard event files through tensorboardX (no TensorFlow needed)."""

from __future__ import annotations

from dpax.writers import MetricWriter, scalars


class TensorBoardWriter(MetricWriter):
    """One scalar series per metric; `tensorboard --logdir RUN_DIR/tensorboard`."""

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self._w = SummaryWriter(logdir=logdir)

    def write(self, step: int, row: dict) -> None:
        for key, value in scalars(row).items():
            if key != "epoch":
                self._w.add_scalar(key, value, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()
