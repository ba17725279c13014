"""A sharded model's small trainable state, gathered whole to rank 0 and written in the
single-process format (LoRA under FSDP): only node 0 writes, only node 0 reads.

Saving gathers the trainable weights and the optimizer state whole on rank 0's CPU
(`get_state_dict(..., full_state_dict=True)`); rank 0 writes `adapter/` (or `model/`),
`optimizer.safetensors` and `optimizer.json` as one process does, the optimizer's entries
numbered in its own parameter order. Loading reads them on rank 0, names them back with the
model's parameter names, and `set_state_dict(..., broadcast_from_rank0=True)` gives every rank
its shards: the other ranks read nothing.

`save_gathered(folder, model, optimizer, method)`, `load_gathered(folder, model, optimizer,
method, is_main)`, `by_index(optim_sd)`, `by_name(optim_sd, names)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_REST = "optimizer.json"
# prefixes wrappers add to parameter names that state dicts leave out
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _options(load: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        full_state_dict=True,
        cpu_offload=not load,
        ignore_frozen_params=True,
        broadcast_from_rank0=load,
        strict=not load,
    )


def by_index(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict keyed by parameter names (`get_state_dict`'s) as `optimizer.state_dict()`
    keys it: parameters numbered across the groups, in the groups' order."""
    ids: dict[str, int] = {}
    groups = []
    for group in optim_sd["param_groups"]:
        params = []
        for name in group["params"]:
            ids[name] = len(ids)
            params.append(ids[name])
        groups.append({**group, "params": params})
    return {"state": {ids[n]: v for n, v in optim_sd["state"].items()}, "param_groups": groups}


def by_name(optim_sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `by_index`: `names[i]` is the name of the optimizer's parameter i."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]]
    return {
        "state": {names[int(i)]: v for i, v in optim_sd["state"].items()},
        "param_groups": groups,
    }


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The state-dict name of each of the optimizer's parameters, in its own order."""
    names = {}
    for name, p in model.named_parameters():
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        names[id(p)] = name
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def save_gathered(
    folder: Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, method: str
) -> dict[str, Any]:
    """Gather the trainable weights and the optimizer state to rank 0 (`folder` there, None
    elsewhere), which writes them in the single-process format; state.json's fields. A
    collective."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tunelab.core.records import write_json_atomic
    from tunelab.lib.models import save_trainable, trainable_dirname
    from tunelab.stages.train.checkpoint import flatten_optimizer
    from tunelab.stages.train.resume_check import optimizer_layout

    weights, optim_sd = get_state_dict(model, optimizer, options=_options())
    layout = optimizer_layout(model, optimizer)  # the state's keys: same on every rank
    if folder is None:
        return {}
    save_trainable(model, folder / trainable_dirname(method), method, weights=weights)
    tensors, rest = flatten_optimizer(by_index(optim_sd))
    save_file(tensors, str(folder / OPTIMIZER_TENSORS))
    write_json_atomic(folder / OPTIMIZER_REST, rest)
    return {"optimizer_layout": layout, "gathered": True}


def load_gathered(
    folder: Path | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    method: str,
    is_main: bool,
) -> None:
    """Rank 0 reads the gathered checkpoint in `folder`; every rank gets its shards of the
    weights and optimizer state. A collective."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, Any] = {}
    if is_main:
        weights = read_trainable(folder, model, method)
        if optimizer is not None:
            optim_sd = by_name(read_optimizer(folder), parameter_names(model, optimizer))
    # two calls, not set_state_dict: it takes the other ranks' empty model state dict for
    # "optimizer only" and skips the model's broadcast there, while rank 0 enters it
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=_options(load=True))
    set_model_state_dict(model, weights, options=_options(load=True))


def read_optimizer(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from tunelab.core.records import read_json
    from tunelab.stages.train.checkpoint import unflatten_optimizer

    meta = read_json(folder / OPTIMIZER_REST)
    return unflatten_optimizer(load_file(str(folder / OPTIMIZER_TENSORS)), meta)


def read_trainable(folder: Path, model: torch.nn.Module, method: str) -> dict[str, torch.Tensor]:
    """The checkpoint's trainable tensors by the model's state-dict names. A LoRA adapter's
    file names them as peft saves them: the names `save_trainable` derives from the model's
    are found by handing peft one numbered marker per trainable tensor."""
    from safetensors.torch import load_file

    from tunelab.core.errors import CheckpointError
    from tunelab.lib.models import trainable_dirname

    src = folder / trainable_dirname(method)
    files = sorted(src.glob("*.safetensors"))
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(str(f)))
    if method not in ("lora", "qlora"):
        return saved
    from peft.utils import get_peft_model_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    markers = {n: torch.tensor([i]) for i, n in enumerate(names)}
    as_saved = get_peft_model_state_dict(model, state_dict=markers)
    missing = sorted(set(as_saved) - set(saved))
    if missing:
        raise CheckpointError(
            f"{src}: the adapter lacks {len(missing)} tensor(s) of the run, e.g. {missing[0]}",
            hint="the checkpoint is damaged; resume from an earlier one",
        )
    return {names[int(m.item())]: saved[key] for key, m in as_saved.items()}
