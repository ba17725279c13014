"""The typed kinds of a training run's own files: a checkpoint's state.json and the run's
preprocess.json (see `core/record_base.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunelab.core.record_base import Record

__all__ = ["CheckpointState", "RunPreprocess", "SplitLengths"]


@dataclass(frozen=True)
class CheckpointState(Record):
    """<run>/checkpoints/step-N/state.json: where training stood at the save (its step, data
    position and counters), how it ran (strategy, world size), the generators' and the grad
    scaler's state, where a sharded save keeps its shards, and the sha256 of every file of the
    checkpoint. `stages/train/resume_check.py` checks the generators' and the optimizer's
    layouts it records, from `raw`."""

    step: int = 0
    files: dict[str, str] = field(default_factory=dict, repr=False)
    position: dict[str, Any] = field(default_factory=dict)
    tokens_seen: int = 0
    loss_tokens_seen: int = 0
    last_loss: float | None = None
    elapsed_s: float | None = None  # training seconds before the save
    strategy: str | None = None  # None: written by one process
    world_size: int | None = None
    config_sha256: str | None = None
    data_snapshot: str | None = None
    grad_scaler: dict[str, Any] | None = field(default=None, repr=False)
    rng: dict[str, Any] | None = field(default=None, repr=False)  # rank 0's generators
    rank_rng: list[Any] | None = field(default=None, repr=False)  # every other rank's
    shards: str | None = None  # a full fine-tune's shard store location (several nodes)
    saved_at: str | None = None

    @property
    def launched(self) -> tuple[str, int]:
        """(strategy, number of processes) the checkpoint was written by."""
        return self.strategy or "single", self.world_size or 1


@dataclass(frozen=True)
class SplitLengths(Record):
    """One split's lengths as its run encoded it: the examples, and those max_seq_len cut."""

    n: int | None = None
    truncated: int | None = None
    share_truncated: float | None = None  # None for an empty split


@dataclass(frozen=True)
class RunPreprocess(Record):
    """runs/<run>/preprocess.json (stages.train): the chat template's sha256 the run trained
    with, which evaluation and export check, and each split's counts (older runs counted the
    train split only, or none)."""

    template_sha256: str | None = None

    def split(self, name: str) -> SplitLengths | None:
        return self.part(SplitLengths, name)

    def check_parts(self) -> None:
        _ = self.split("train"), self.split("validation")
