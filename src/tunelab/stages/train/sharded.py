"""FSDP's checkpoints: a full fine-tune's shards through torch.distributed.checkpoint, every
other method's trainable state gathered to rank 0.

- A full fine-tune (`method: full`) writes each rank's shards of the weights and optimizer
  states through torch.distributed.checkpoint (loadable on any world size): into the
  checkpoint's `dcp/` folder on one node, into `training.shard_store` on several nodes
  (`tunelab.stages.train.shard_store`; state.json's `shards` records where). Rank 0 adds the
  weights gathered whole in the single-process format (`model/`), so that evaluation, verify
  and export load an FSDP run like any other.
- LoRA and the other methods, whose trainable state is small: the trainable weights and the
  optimizer state are gathered whole to rank 0, which writes them in the single-process format
  (`adapter/` or `model/`, optimizer.safetensors + optimizer.json). Nothing is written by the
  other ranks, so nodes need no shared disk. A resume reads them on rank 0 and
  `set_state_dict(..., broadcast_from_rank0=True)` gives every rank its shards.

The rest of the checkpoint (scheduler, generators, state.json) is
`tunelab.stages.train.checkpoint`'s.

`ShardedCheckpoint(strategy)` (FSDP's shard writer), `SHARDED_METHODS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tunelab.core.errors import RunError
from tunelab.core.record_train import CheckpointState
from tunelab.stages.train import shard_store
from tunelab.stages.train.gathered import load_gathered, save_gathered

DCP_DIR = "dcp"
# the methods whose checkpoint stays sharded; every other one is gathered to rank 0
SHARDED_METHODS = ("full",)


def _state_options(full: bool = False, load: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen base weights never change: a LoRA checkpoint holds the adapter and its optimizer.
    # Loading such a state dict must not be strict (the frozen keys are absent on purpose);
    # dcp.load has already refused a checkpoint missing any trainable key.
    return StateDictOptions(
        ignore_frozen_params=True, full_state_dict=full, cpu_offload=full, strict=not load
    )


def save_sharded(where: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the trainable weights and optimizer states to `where`
    (a folder or a store URL; torch.distributed.checkpoint). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=shard_store.writer(where))


def load_sharded(where: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the shards at `where` into the sharded model and optimizer (any world size). A
    collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not shard_store.has_shards(where):
        raise RunError(
            f"{where}: no torch.distributed.checkpoint here",
            hint="this checkpoint was not written by --strategy fsdp, or its shard store is "
            "gone; resume with the strategy that wrote it, from a store every node reaches",
        )
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, storage_reader=shard_store.reader(where))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_state_options(load=True),
    )


def full_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors gathered whole on CPU (rank 0 gets them; others an empty dict).
    A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_options(full=True))


class ShardedCheckpoint:
    """FSDP's shard writer (see the module): a full fine-tune's shards through
    torch.distributed.checkpoint, every other method gathered to rank 0. `strategy` shares
    rank 0's choices with the other ranks."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    def save(
        self,
        folder: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        method: str,
        shards_at: str | None = None,
    ) -> dict[str, Any]:
        """Write the checkpoint's weights and optimizer states; `folder` is rank 0's temporary
        checkpoint folder (None on the other ranks), `shards_at` the store location of a full
        fine-tune's shards on several nodes. Returns state.json's fields. A collective."""
        from tunelab.lib.models import save_trainable, trainable_dirname

        if method not in SHARDED_METHODS:
            return save_gathered(folder, model, optimizer, method)
        # one node: every rank writes into rank 0's checkpoint folder (the same disk)
        where = shards_at or self.strategy.broadcast_object(
            str(folder / DCP_DIR) if self.is_main else None
        )
        save_sharded(where, model, optimizer)
        weights = full_trainable_state(model)  # [full tensors on rank 0's CPU]
        if self.is_main:
            save_trainable(model, folder / trainable_dirname(method), method, weights=weights)
        if shards_at:
            return {"optimizer": "shards (torch.distributed.checkpoint)", "shards": shards_at}
        return {"optimizer": f"{DCP_DIR}/ (torch.distributed.checkpoint, sharded)"}

    def load(
        self,
        folder: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        method: str,
        shards: str | None = None,
    ) -> None:
        """Load a checkpoint: `shards` where its shards are (rank 0's answer, on every rank;
        None when rank 0 holds it gathered in `folder`). A collective."""
        if shards is None:
            load_gathered(folder, model, optimizer, method, self.is_main)
        else:
            load_sharded(shards, model, optimizer)

    def shards_of(self, folder: Path, state: CheckpointState) -> str | None:
        """Rank 0: where the checkpoint `folder` (its state.json `state`) keeps its shards:
        the store location it recorded, its `dcp/` folder, or None (gathered)."""
        if state.shards:
            return state.shards
        dcp_dir = folder / DCP_DIR
        return str(dcp_dir) if (dcp_dir / ".metadata").exists() else None
