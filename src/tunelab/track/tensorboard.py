"""TensorBoard event files in a run folder: `tensorboard --logdir records/runs` shows every run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tunelab.track.flatten import Point
from tunelab.track.optional import summary_writer_class

EVENTS_DIR = "tensorboard"


class TensorBoardWriter:
    """Scalars of a run under `<run>/tensorboard/`, keyed as the MLflow mirror keys them
    (train/loss, validation/loss, system/memory_bytes, ...). Raises TrackingError without the
    `tracking` extra."""

    def __init__(self, run_dir: Path, flush_s: float = 10.0):
        self.dir = Path(run_dir) / EVENTS_DIR
        self._writer = summary_writer_class()(log_dir=str(self.dir), flush_secs=flush_s)

    def write(self, points: Iterable[Point]) -> None:
        for p in points:
            self._writer.add_scalar(p.key, p.value, p.step, walltime=p.timestamp_ms / 1000)

    def close(self) -> None:
        self._writer.close()
