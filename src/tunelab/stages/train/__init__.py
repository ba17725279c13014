"""Training: batches, the loop, checkpoints, and runs recorded in the study.

- `collate(encoded, pad_id, architecture, packing)` and the seeded data order (`batches`)
- `train_loop(loop, state, callbacks)` (`loop`): token-normalized accumulation, clipping,
  precision; `build_model` / `build_loop` (`build`): what the loop trains, for train and size
- the step callbacks of a run (`callbacks`): metrics, validation, checkpoints, update check,
  heartbeat, progress, signals
- `save_checkpoint` / `load_checkpoint` / `check_checkpoint_files` (`checkpoint`): atomic,
  safetensors + JSON, no pickle, every strategy
- `run` (the entry point of `tunelab train`), `load_run_model` (`stage`); `resume_run`
  (`resume`)

The loss of an optimizer step is the summed cross-entropy of its micro-batches divided by the
total number of loss tokens across them (counted before the forwards; an encoder example is one
loss token). `tunelab.stages.train.layout` imports no torch.
"""

from __future__ import annotations

from tunelab.core.lazy import lazy_names

# Names load on first use (PEP 562): `tunelab.stages.train.layout` and the commands that only look for
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
    "RunFailed": "stage",
    "RunInterrupted": "callbacks",
    "load_run_model": "stage",
    "read_metrics": "stage",
    "resume_run": "resume",
    "SingleProcess": "strategy",
    "Strategy": "strategy",
}

__getattr__ = lazy_names(__name__, globals(), _HOMES)


__all__ = sorted(_HOMES)
