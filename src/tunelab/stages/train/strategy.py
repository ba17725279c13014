"""The seam between the training loop and parallelism.

The loop asks a strategy to wrap the model, to pick this rank's share of each step's examples, to
sum counts across ranks, and whether a micro-step must synchronize gradients. The run asks it to
share objects between ranks (rank 0 creates the record, the others follow it) and, through
`shard_writer`, how a checkpoint holds the model: None for a full replica on rank 0 (the single
process and DDP), a `ShardWriter` where each rank holds only its shards (FSDP). A single process
is the identity.

`Strategy`: `name` ("single" | "ddp" | "fsdp"), `rank`, `world_size`, `is_main`, `wrap_model`,
`unwrap`, `shard_indices`, `all_reduce_sum`, `broadcast_object`, `gather_objects`, `barrier`,
`describe()` (env.json's `distributed`, None for a single process), `accumulate(model, last)`,
and `shard_writer` (`ShardWriter.save(folder, model, optimizer, method, shards_at) -> state
fields`, `load(...)`, `shards_of(folder, state)`; collectives). `SingleProcess` is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tunelab.core.record_train import CheckpointState

if TYPE_CHECKING:  # torch stays unimported for the commands that only read checkpoints
    import torch


class ShardWriter(Protocol):
    """Writes and reads the weights and optimizer states of a sharded model; collectives.
    `folder` is the checkpoint's folder on rank 0 and None on the other ranks."""

    def save(
        self,
        folder: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        method: str,
        shards_at: str | None = None,
    ) -> dict[str, Any]:
        """Write the checkpoint's weights and optimizer states (each rank's shards to
        `shards_at` or rank 0's folder, or gathered to rank 0); returns fields for
        state.json."""
        ...

    def load(
        self,
        folder: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        method: str,
        shards: str | None = None,
    ) -> None: ...

    def shards_of(self, folder: Path, state: CheckpointState) -> str | None:
        """Rank 0: where checkpoint `folder` keeps its shards (None: gathered in it)."""
        ...


class Strategy(Protocol):
    name: str
    rank: int
    world_size: int
    shard_writer: ShardWriter | None

    @property
    def is_main(self) -> bool: ...

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose state a replica checkpoint holds (DDP's `module`)."""
        ...

    def shard_indices(self, indices: list[int]) -> list[int]: ...

    def all_reduce_sum(self, value: float) -> float: ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        ...

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        ...

    def barrier(self) -> None: ...

    def use_precision(self, precision: str) -> None:
        """Compute in `precision` from now on (a resume takes the run's own, before wrapping)."""
        ...

    def describe(self) -> dict[str, Any] | None:
        """The `distributed` entry of env.json (None for a single process); a collective."""
        ...

    def accumulate(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; gradients are synchronized only when `last` (DDP no_sync)."""
        ...


class SingleProcess:
    """One process, one device: every member is the identity."""

    name = "single"
    rank = 0
    world_size = 1
    shard_writer = None

    @property
    def is_main(self) -> bool:
        return True

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def shard_indices(self, indices: list[int]) -> list[int]:
        return indices

    def all_reduce_sum(self, value: float) -> float:
        return value

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def use_precision(self, precision: str) -> None:
        pass  # one process reads training.precision where it computes

    def describe(self) -> dict[str, Any] | None:
        return None

    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module, last: bool) -> Iterator[None]:
        yield
