"""Training: batches, the loop, checkpoints, and runs recorded in the study.

- `collate(encoded, pad_id, architecture, packing)` and the seeded data order (`batches`)
- `train_loop(loop, state, callbacks)` (`loop`): token-normalized accumulation, clipping,
  precision; `build_model` / `build_loop` (`build`): what the loop trains, for train and size
- the step callbacks of a run (`callbacks`): metrics, validation, checkpoints, update check,
  heartbeat, progress, signals
- `save_checkpoint` / `load_checkpoint` / `check_checkpoint_files` (`checkpoint`): atomic,
  safetensors + JSON, no pickle, every strategy
- `train_run`, `resume_run`, `load_run_model` (`run`)
"""

from __future__ import annotations

import importlib
from typing import Any

# Names load on first use (PEP 562): `tunelab.train.layout` and the commands that only look for
# a checkpoint stay free of torch's import (about 2 s on a CPU machine).
_HOMES = {
    "DataOrder": "batches",
    "Position": "batches",
    "StepSource": "batches",
    "collate": "batches",
    "InvalidRun": "loop",
    "Loop": "loop",
    "TrainState": "loop",
    "train_loop": "loop",
    "validation_loss": "loop",
    "RunFailed": "run",
    "RunInterrupted": "callbacks",
    "load_run_model": "run",
    "read_metrics": "run",
    "resume_run": "run",
    "train_run": "run",
    "SingleProcess": "strategy",
    "Strategy": "strategy",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


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
