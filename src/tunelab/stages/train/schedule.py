"""How many optimizer steps a run takes and the learning rate of each: pure arithmetic, no torch,
so that the planner counts the steps of a run as training will.

`total_steps(cfg, num_train, world_size=1)` (the optimizer steps of a run) and `lr_factor(step,
training_cfg, total_steps)`.
"""

from __future__ import annotations

import math

from tunelab.core.config import StudyConfig
from tunelab.core.config_training import TrainingConfig


def total_steps(cfg: StudyConfig, num_train: int, world_size: int = 1) -> int:
    """training.max_steps, else the steps of num_epochs over `num_train` examples, each step
    taking micro_batch_size x grad_accum_steps x world_size of them."""
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    per_step = t.micro_batch_size * t.grad_accum_steps * world_size
    return max(1, math.ceil(t.num_epochs * num_train / per_step))


def lr_factor(step: int, cfg: TrainingConfig, total_steps: int) -> float:
    """Multiplier of training.lr for the 0-based optimizer step `step`.

    Warm-up rises linearly to 1 over warmup_steps (never 0 at the first step); then constant,
    linear decay, or cosine decay, ending just above 0 at the last step.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
