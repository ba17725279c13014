"""The seam between the training loop and parallelism.

The loop asks a strategy to wrap the model, to pick this rank's share of each step's examples, to
sum counts across ranks, and whether a micro-step must synchronize gradients. A single process is
the identity; DDP and FSDP strategies implement the same five members.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Strategy(Protocol):
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def shard_indices(self, indices: list[int]) -> list[int]: ...

    def all_reduce_sum(self, value: float) -> float: ...

    def accumulate(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; gradients are synchronized only when `last` (DDP no_sync)."""
        ...


class SingleProcess:
    """One process, one device: every member is the identity."""

    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        return True

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def shard_indices(self, indices: list[int]) -> list[int]:
        return indices

    def all_reduce_sum(self, value: float) -> float:
        return value

    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module, last: bool) -> Iterator[None]:
        yield
