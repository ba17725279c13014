"""What the loop trains, built in one place for `tunelab train` and `tunelab size`.

`build_model` turns a base model into the model that trains: loaded, adapted (full, LoRA,
freeze), activation checkpointing, on its device, its blocks compiled when `training.compile`.
`build_loop` gives it what the loop needs: the strategy's wrapping, the optimizer over the
trainable parameters, the schedule, the grad scaler of the precision, and the seeded order of
the examples.

`build_model(base, cfg, labels, device) -> (model, audit)` (seeded: load, adapt, activation
checkpointing, `compute.prepare_model`, device) and `build_loop(model, training_cfg, encoded, *,
architecture, pad_id, total_steps, strategy=None, views=None) -> Loop` (strategy wrapping,
optimizer, schedule, grad scaler, data order): `tunelab train` and `tunelab size` both build
through them.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tunelab.core.config import StudyConfig
from tunelab.core.config_training import TrainingConfig
from tunelab.stages.train.batches import DataOrder, StepSource
from tunelab.stages.train.compute import prepare_model
from tunelab.stages.train.loop import Loop, build_optimizer, build_scheduler, make_grad_scaler
from tunelab.stages.train.strategy import SingleProcess, Strategy

if TYPE_CHECKING:
    from tunelab.lib.models import BaseModel


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_model(
    base: BaseModel,
    cfg: StudyConfig,
    labels: list[str] | None,
    device: torch.device,
    strategy: Strategy | None = None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The adapted model on `device` and its audit (trainable and frozen parameters).

    Seeds every generator with `training.seed` first: a new head and LoRA's matrices start the
    same in every run of the config. A strategy that loads sharded (FSDP) gets a skeleton
    instead: base weights as storage-less placeholders, adapter tensors real (`tunelab.lib.models.skeleton`);
    it fills them shard by shard when it wraps the model.
    """
    from tunelab.lib.models import adapt, enable_activation_checkpointing, load_model
    from tunelab.lib.models.skeleton import load_skeleton

    seed_everything(cfg.training.seed)
    loads_sharded = getattr(strategy, "loads_sharded", None)
    skeleton = bool(loads_sharded and loads_sharded(base, cfg))
    loaded = load_skeleton(base, cfg) if skeleton else load_model(base, cfg, labels)
    model, audit = adapt(loaded, cfg.adaptation, base.architecture)
    if cfg.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    if not skeleton:
        model = model.to(device)
    prepare_model(model, cfg.training, device)  # training.compile, before any wrapping
    return model, audit


def build_loop(
    model: torch.nn.Module,
    cfg: TrainingConfig,
    encoded: list[dict[str, Any]],
    *,
    architecture: str,
    pad_id: int,
    total_steps: int,
    strategy: Strategy | None = None,
    views: Any = None,
) -> Loop:
    """The loop over `encoded` for `total_steps` optimizer steps (the schedule's length too);
    `views(i, epoch)`, when given, is example i as it is read in that epoch.

    The model is wrapped by the strategy (DDP, FSDP) before the optimizer sees its parameters;
    `loop.model` is the wrapped one.
    """
    strategy = strategy or SingleProcess()
    model = strategy.wrap_model(model)  # a skeleton gets its storage here (sharded loading)
    device = next(model.parameters()).device
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    source = StepSource(
        encoded,
        DataOrder(len(encoded), cfg.seed),
        cfg.micro_batch_size,
        cfg.grad_accum_steps,
        pad_id,
        architecture,
        cfg.packing and architecture == "causal_lm",
        strategy.world_size,
        strategy.shard_indices,
        views,
    )
    scaler = make_grad_scaler(cfg.precision, device)
    return Loop(
        model, optimizer, scheduler, source, cfg, total_steps, architecture, strategy, scaler
    )
