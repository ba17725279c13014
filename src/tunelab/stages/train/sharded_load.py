"""Sharded loading under FSDP: each rank reads only its own rows of the base's weights.

The model arrives as a skeleton (`tunelab.lib.models.skeleton`: base parameters are
storage-less placeholders, the adapter's new tensors real). `before_sharding` broadcasts rank
0's new tensors (LoRA's matrices, created whole from the seeded generator on every rank), so
every rank holds the same. `fully_shard` splits every parameter's first dimension over the
ranks (torch.chunk's split: ceil(rows / N) rows each, the last ranks shorter) and allocates
each rank's shard; `materialize` fills the base weights' shards with this rank's rows, read
from the safetensors files (`WeightFiles.read_rows` touches only those bytes), so a rank's host
memory holds 1/N of the weights, never the whole. Buffers (rotary frequencies) are computed at
construction.

Why every rank reads its own rows rather than rank 0 reading and scattering: on one node the
ranks read the same page cache and the transfer costs nothing; rank 0 would hold each whole
tensor and send N-1 shards through the process group (gloo copies them through sockets on a
CPU). benchmarks/fsdp_load.py measures both (benchmarks/RESULTS.md). The cost is that every
node needs the base's files, which the runs already need for evaluation and export.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tunelab.core.errors import ModelError

# A diagnostic for the benchmark: "replicated" loads the whole base on every rank and
# broadcasts rank 0's weights (the losses are the same; only memory differs).
LOAD_ENV = "TUNELAB_FSDP_LOAD"
ADAPTER_SEGMENTS = (".base_layer", ".original_module", ".modules_to_save.default")


def sharded_load_wanted(base: Any, cfg: Any) -> bool:
    """Whether FSDP builds this study's model as a skeleton and loads it shard by shard: causal
    LMs in full precision (see `tunelab.lib.models.skeleton.load_skeleton`)."""
    if os.environ.get(LOAD_ENV) == "replicated":
        return False
    return base.architecture == "causal_lm" and cfg.adaptation.method != "qlora"


def is_skeleton(model: torch.nn.Module) -> bool:
    from tunelab.lib.models.skeleton import skeleton_of

    return hasattr(skeleton_of(model), "tunelab_weight_files")


def rows_of(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows [start, end) of a first dimension of `n` that FSDP2's Shard(0) gives `rank`."""
    per = math.ceil(n / world_size) if n else 0
    start = min(rank * per, n)
    return start, min(start + per, n)


def base_key(name: str) -> str:
    """The parameter's name in the base model: peft's wrapping segments and prefix removed."""
    name = name.removeprefix("base_model.model.")
    for segment in ADAPTER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@dataclass
class Pending:
    """What a skeleton keeps across `fully_shard`: the placeholders' names, the adapter's
    tensors whole (equal on every rank) and the buffers."""

    to_load: list[str]
    news: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def before_sharding(model: torch.nn.Module) -> Pending:
    """Broadcast rank 0's new tensors (every rank then holds the same) and keep them, with the
    buffers, for `materialize`; the placeholders become meta tensors. A collective."""
    from tunelab.lib.models.skeleton import placeholders_to_meta

    to_load = placeholders_to_meta(model)
    news = {n: p.detach() for n, p in model.named_parameters() if p.device.type != "meta"}
    for t in news.values():
        dist.broadcast(t, src=0)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return Pending(to_load, news, buffers)


def materialize(
    model: torch.nn.Module, pending: Pending, device: torch.device, rank: int, world_size: int
) -> int:
    """Give the sharded `model` storage on `device` for this rank's shards and fill them: the
    base's rows from its weight files, the new tensors' rows from `pending`; returns the bytes
    read from the files."""
    from tunelab.lib.models.skeleton import skeleton_of

    inner = skeleton_of(model)
    files = inner.tunelab_weight_files
    prefix = getattr(inner, "base_model_prefix", "")
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(pending.buffers[name])
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            start, end = rows_of(p.shape[0], rank, world_size) if p.dim() else (0, 0)
            if p.dim() and local.shape[0] != end - start:
                raise AssertionError(f"{name}: {local.shape[0]} local rows, not {end - start}")
            if name in pending.news:
                new = pending.news[name]
                local.copy_(new[start:end] if p.dim() else new)
                continue
            key = files.key_for(base_key(name), prefix)
            if key is None:
                raise ModelError(
                    f"{files.folder}: no tensor for parameter {name}",
                    hint="the base's files do not match its config.json",
                )
            local.copy_(files.read_rows(key, start, end, local.dtype))
    return files.bytes_read
