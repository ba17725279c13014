"""The validation loss as a run computes it: the same encoding, batches and normalization.

A run evaluates its `val_loss` on `validation_batches`; `validation_loss_of` gives the loss of
any model on any rows the same way (the smoke compares a reloaded checkpoint's with the live
model's).

`validation_batches(encoded, training_cfg, pad_id, architecture)` and `validation_loss_of(model,
tokenizer, base, cfg, rows, labels) -> float` (verify's fresh process computes the smoke's
with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunelab.core.config import StudyConfig
from tunelab.core.config_training import TrainingConfig
from tunelab.stages.train.batches import eval_batches
from tunelab.stages.train.loop import validation_loss

if TYPE_CHECKING:
    import torch

    from tunelab.lib.models import BaseModel


def validation_batches(
    encoded: list[dict[str, Any]], cfg: TrainingConfig, pad_id: int, architecture: str
) -> list[dict[str, torch.Tensor]]:
    """The encoded validation examples in order, in micro-batches of the training's size
    (packed where training packs)."""
    packing = cfg.packing and architecture == "causal_lm"
    return eval_batches(encoded, cfg.micro_batch_size, pad_id, architecture, packing)


def validation_loss_of(
    model: torch.nn.Module,
    tokenizer: Any,
    base: BaseModel,
    cfg: StudyConfig,
    rows: list[dict[str, Any]],
    labels: list[str] | None,
) -> float:
    """The training loop's validation loss of `model` on `rows` (same encoding and batches as
    the run's `val_loss`), on the model's device."""
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    pre = Preprocessor(tokenizer, cfg, get_task(cfg, labels), base.architecture)
    encoded = [pre.encode(r) for r in rows]
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0  # an image processor has none
    batches = validation_batches(encoded, cfg.training, pad_id, base.architecture)
    loss, _ = validation_loss(model, batches, base.architecture, cfg.training.precision)
    return float(loss)
