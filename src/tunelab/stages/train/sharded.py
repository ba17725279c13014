"""FSDP's checkpoints: each rank writes its shards through torch.distributed.checkpoint.

A sharded checkpoint holds `dcp/` (every rank's shards of the trainable weights and optimizer
states, loadable on any world size) and, written by rank 0, the trainable weights gathered whole
in the single-process format (`adapter/` or `model/`), so that evaluation, verify and export
load an FSDP run like any other. The rest of the checkpoint (scheduler, generators, state.json)
is `tunelab.stages.train.checkpoint`'s.

`ShardedCheckpoint` (FSDP's shard writer; rank 0 writes the gathered weights with
`tunelab.lib.models.save_trainable`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tunelab.core.errors import RunError

DCP_DIR = "dcp"


def _state_options(full: bool = False, load: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen base weights never change: a LoRA checkpoint holds the adapter and its optimizer.
    # Loading such a state dict must not be strict (the frozen keys are absent on purpose);
    # dcp.load has already refused a checkpoint missing any trainable key.
    return StateDictOptions(
        ignore_frozen_params=True, full_state_dict=full, cpu_offload=full, strict=not load
    )


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Every rank writes its shards of the trainable weights and optimizer states to
    `folder/dcp` (torch.distributed.checkpoint). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    out = folder / DCP_DIR
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(out))
    return out


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load `folder/dcp` into the sharded model and optimizer (any world size). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    src = folder / DCP_DIR
    if not (src / ".metadata").exists():
        raise RunError(
            f"{src}: no torch.distributed.checkpoint here",
            hint="this checkpoint was not written by --strategy fsdp; resume it with the "
            "strategy that wrote it",
        )
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(src))
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
    """FSDP's shard writer: every rank writes its shards of the trainable weights and optimizer
    states into `dcp/`; rank 0 adds the gathered trainable weights in the single-process format
    (`adapter/` or `model/`), which evaluation, verify and export load like any other."""

    def __init__(self, is_main: bool):
        self.is_main = is_main

    def save(
        self, folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, method: str
    ) -> dict[str, Any]:
        from tunelab.lib.models import save_trainable, trainable_dirname

        save_sharded(folder, model, optimizer)
        weights = full_trainable_state(model)  # [full tensors on rank 0's CPU]
        if self.is_main:
            save_trainable(model, folder / trainable_dirname(method), method, weights=weights)
        return {"optimizer": f"{DCP_DIR}/ (torch.distributed.checkpoint, sharded)"}

    def load(
        self, folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, method: str
    ) -> None:
        load_sharded(folder, model, optimizer)
