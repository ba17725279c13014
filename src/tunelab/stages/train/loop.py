"""The training loop: one loop for every model, adaptation and (later) parallel strategy.

Loss normalization: the loss of an optimizer step is the summed token cross-entropy of all its
micro-batches divided by the number of loss tokens in the whole step (counted before the forward
passes). So micro 4 x accumulation 2 gives the same loss and gradients as micro 8 x 1, whatever
the lengths. For an encoder classifier each example is one loss "token".

`train_loop(Loop(model, optimizer, scheduler, source, cfg, total_steps, architecture, strategy,
scaler), TrainState, callbacks)`: after every optimizer step it calls each `callback(state,
row)` of the list in order (`StepCallback`); a callback may extend the row, log, evaluate,
checkpoint, or stop the run by raising. `loss_sum` (an image model: `model(pixel_values=...)`;
a causal LM: `tunelab.stages.train.losses.causal_lm_loss_sum`), `validation_loss(model, batches,
architecture, precision) -> (loss, loss_tokens)`, `autocast`, `to_device`,
`build_optimizer` (any `torch.optim` optimizer by name, or bitsandbytes' 8-bit ones),
`optimizer_problems` (for `tunelab validate`). `InvalidRun(RunError)`: a non-finite loss, no
loss tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tunelab.core.config_training import TrainingConfig
from tunelab.core.errors import ConfigError, RunError
from tunelab.stages.train.batches import (
    Position,
    StepSource,
    count_input_tokens,
    count_loss_tokens,
)
from tunelab.stages.train.losses import causal_lm_loss_sum
from tunelab.stages.train.precision import resolve_precision
from tunelab.stages.train.schedule import lr_factor
from tunelab.stages.train.strategy import SingleProcess, Strategy


class InvalidRun(RunError):
    """Training produced a result that cannot be trusted: non-finite loss, no loss tokens, ..."""


@dataclass
class TrainState:
    """What a checkpoint must restore besides weights, optimizer, scheduler and RNG."""

    step: int = 0
    position: Position = field(default_factory=Position)
    tokens_seen: int = 0
    loss_tokens_seen: int = 0
    last_loss: float | None = None


# ------------------------------------------------------------------ optimizer and schedule


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """torch.optim's optimizer `name`, or bitsandbytes' 8-bit AdamW (`BNB_OPTIMIZERS`); a
    ConfigError listing the known names otherwise."""
    from tunelab.lib.models.quantize import BNB_OPTIMIZERS, bnb_optimizer

    cls = bnb_optimizer(name) if name in BNB_OPTIMIZERS else None
    cls = cls or getattr(torch.optim, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        known = sorted(
            n
            for n, c in vars(torch.optim).items()
            if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and n != "Optimizer"
        )
        raise ConfigError(
            f"training.optimizer: unknown optimizer {name!r}",
            hint=f"use one of torch.optim's: {', '.join(known)}; or bitsandbytes' "
            + ", ".join(BNB_OPTIMIZERS),
        )
    return cls


def optimizer_problems(cfg: TrainingConfig) -> list[str]:
    """`tunelab validate`'s line for an optimizer name training would refuse (empty when known;
    a missing bitsandbytes is `quantize.qlora_problems`' to report)."""
    from tunelab.lib.models.quantize import BNB_OPTIMIZERS

    if cfg.optimizer in BNB_OPTIMIZERS:
        return []
    try:
        optimizer_class(cfg.optimizer)
    except ConfigError as exc:
        return [f"{exc.message} ({exc.hint})"]
    return []


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainingConfig) -> torch.optim.Optimizer:
    """`optimizer_class(cfg.optimizer)` over `params`, with lr, weight_decay and betas passed
    where it takes them."""
    cls = optimizer_class(cfg.optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"lr": cfg.lr}
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = cfg.weight_decay
    if "betas" in accepted:
        kwargs["betas"] = tuple(cfg.betas)
    return cls(params, **kwargs)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 / fp16 autocast on the model's device; fp32 runs as is ("auto": see
    `tunelab.stages.train.precision.resolve_precision`)."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A grad scaler for fp16 on CUDA; a disabled (pass-through) one otherwise."""
    precision = resolve_precision(precision, device)
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            "training.precision: fp16 needs a CUDA device (it trains with a grad scaler)",
            hint="use --set training.precision=bf16 or fp32 on CPU",
        )
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


# ------------------------------------------------------------------ loss


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], architecture: str
) -> torch.Tensor:
    """Summed cross-entropy of a collated batch (not divided: the caller normalizes)."""
    if architecture == "causal_lm":  # padded or packed; logits only at loss positions
        return causal_lm_loss_sum(model, batch)
    if architecture == "image":
        from tunelab.lib.models.vision import pixels_for

        logits = model(pixel_values=pixels_for(model, batch["pixel_values"])).logits
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(
        logits.float(), batch["labels"], reduction="sum"
    )  # logits [batch, classes]


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    architecture: str,
    precision: str = "fp32",
    strategy: Strategy | None = None,
) -> tuple[float, int]:
    """Token-normalized loss over the validation batches: (loss, loss tokens)."""
    strategy = strategy or SingleProcess()
    device = model_device(model)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in batches:
        with autocast(precision, device):
            total += float(loss_sum(model, to_device(batch, device), architecture))
        tokens += count_loss_tokens(batch)
    model.train(was_training)
    total, tokens = strategy.all_reduce_sum(total), int(strategy.all_reduce_sum(tokens))
    return (total / tokens if tokens else float("nan")), tokens


# ------------------------------------------------------------------ the loop


@dataclass
class Loop:
    """Everything the loop needs; built by `tunelab.stages.train.stage` or directly in tests."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    source: StepSource
    cfg: TrainingConfig
    total_steps: int
    architecture: str
    strategy: Strategy = field(default_factory=SingleProcess)
    scaler: torch.amp.GradScaler | None = None


# Called after every optimizer step with the state and the step's metrics row (which it may
# extend); it logs, evaluates, checkpoints, and may stop the run by raising.
StepCallback = Callable[[TrainState, dict[str, Any]], None]


def train_loop(loop: Loop, state: TrainState, callbacks: Sequence[StepCallback]) -> TrainState:
    """Run optimizer steps from `state` to `loop.total_steps`, calling each of `callbacks` in
    order after every step."""
    model, optimizer, cfg, strategy = loop.model, loop.optimizer, loop.cfg, loop.strategy
    device = model_device(model)
    scaler = loop.scaler or make_grad_scaler(cfg.precision, device)
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.grad_clip if cfg.grad_clip else float("inf")
    model.train()
    while state.step < loop.total_steps:
        started = time.perf_counter()
        micro_batches, next_position = loop.source.next(state.position)
        loss_tokens = int(strategy.all_reduce_sum(sum(count_loss_tokens(b) for b in micro_batches)))
        if loss_tokens == 0:
            raise InvalidRun(
                f"step {state.step + 1} has no loss tokens (broken loss mask)",
                hint="run `tunelab inspect` to see which positions carry loss",
            )
        # Strategies average gradients over ranks; scale so the result is sum / loss_tokens.
        normalizer = loss_tokens / strategy.world_size
        summed = torch.zeros((), device=device)
        for i, batch in enumerate(micro_batches):
            with strategy.accumulate(model, last=i == len(micro_batches) - 1):
                with autocast(cfg.precision, device):
                    ce = loss_sum(model, to_device(batch, device), loop.architecture)
                scaler.scale(ce / normalizer).backward()
            summed += ce.detach().float()
        loss = strategy.all_reduce_sum(float(summed)) / loss_tokens
        scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(loss) or (not scaler.is_enabled() and not math.isfinite(grad_norm)):
            raise InvalidRun(
                f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step "
                f"{state.step + 1} (loss {loss}, grad norm {grad_norm})",
                hint="lower training.lr, check the data for broken examples, or use fp32",
            )
        lr = loop.scheduler.get_last_lr()[0]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loop.scheduler.step()
        tokens = int(strategy.all_reduce_sum(sum(count_input_tokens(b) for b in micro_batches)))
        state.step += 1
        state.position = next_position
        state.tokens_seen += tokens
        state.loss_tokens_seen += loss_tokens
        state.last_loss = loss
        seconds = time.perf_counter() - started
        row = {
            "step": state.step,
            "epoch": round(loop.source.order.epoch_float(next_position), 6),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "loss_tokens": loss_tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
        }
        for callback in callbacks:
            callback(state, row)
    return state
