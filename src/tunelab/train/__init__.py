"""Training: batches, the loop, checkpoints, and runs recorded in the study.

- `collate(encoded, pad_id, architecture, packing)` and the seeded data order (`batches`)
- `train_loop(loop, state, on_step)` (`loop`): token-normalized accumulation, clipping,
  schedules, precision, activation checkpointing
- `save_checkpoint` / `load_checkpoint` (`checkpoint`): atomic, safetensors + JSON, no pickle
- `train_run`, `resume_run`, `load_run_model` (`run`)
"""

from tunelab.train.batches import DataOrder, Position, StepSource, collate
from tunelab.train.loop import InvalidRun, Loop, TrainState, train_loop, validation_loss
from tunelab.train.run import (
    RunFailed,
    RunInterrupted,
    load_run_model,
    read_metrics,
    resume_run,
    train_run,
)
from tunelab.train.strategy import SingleProcess, Strategy

__all__ = [
    "DataOrder",
    "InvalidRun",
    "Loop",
    "Position",
    "RunFailed",
    "RunInterrupted",
    "SingleProcess",
    "StepSource",
    "Strategy",
    "TrainState",
    "collate",
    "load_run_model",
    "read_metrics",
    "resume_run",
    "train_loop",
    "train_run",
    "validation_loss",
]
