"""The causal-LM loss, computed only where it counts.

Two things make a step of supervised fine-tuning cheaper without changing its result:

- Logits only at loss positions. The LM head (hidden -> vocabulary) is the largest matmul of a
  small model, and with completion-only loss most positions (the prompt) need no logits. The
  decoder body runs on every token; its hidden states are gathered at the loss positions
  BEFORE the head, so the head projects `[loss_tokens, hidden]` instead of `[batch, seq, hidden]`.
  For large vocabularies the cross-entropy runs in chunks whose logits are recomputed in
  backward, so at most one chunk of `[rows, vocab]` logits is alive at a time.
- Padding-free batches (`collate(..., packing=True)`): several examples in one row, positions
  restarting at 0 per example, no attention mask; transformers (sdpa, eager, flash) keeps
  attention inside each example when `use_cache=False`, and a model on "sdpa" is switched to
  per-example attention (`tunelab.train.attention`), which skips the work of the block mask.

Both are exact, and both are checked on the model itself once (`check_model`: a few tokens, no
gradient, no randomness used) before they are relied on: the split body + head must reproduce
the model's own logits (a model that rescales or soft-caps logits after its head fails that, or
declares it in its config, and gets the head applied inside its own forward instead), and a
packed pair of sequences must give the logits of the same pair as a padded batch (a model that
lets packed examples see each other fails that and its packed batches are unpacked into padded
ones, with a warning).

Routes, best first:
- split: `body(...)` -> gather -> `head` -> (chunked) cross-entropy. A plain model or a peft
  model (`PeftModel -> base_model.model -> get_decoder()` and `get_output_embeddings()`; a head
  adapted by LoRA is a module like any other and is applied whole to the gathered rows).
- hook: the model's own forward with a pre-hook on its output embeddings that gathers the
  hidden states; for models wrapped by DDP or FSDP (their forward must run for gradient sync and
  parameter gathering) and models whose forward transforms the logits after the head.
- full: full logits, then the loss positions (a model without output embeddings).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tunelab.train.attention import restore_sdpa, segment_bounds, use_packed_sdpa

IGNORE = -100
CHUNK_LOGITS = 1 << 26  # logits per chunk of cross-entropy (256 MB in fp32)


@dataclass(frozen=True)
class ModelChecks:
    """What the checks found for one model (see the module doc)."""

    route: str  # "split" | "hook" | "full"
    parts: tuple[torch.nn.Module, torch.nn.Module] | None  # (body, head) on the split route
    packing_exact: bool
    packed_attention: bool  # per-example attention (tunelab.train.attention) in use


_CHECKS: weakref.WeakKeyDictionary[torch.nn.Module, ModelChecks] = weakref.WeakKeyDictionary()


def causal_lm_loss_sum(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    chunk_logits: int = CHUNK_LOGITS,
    route: str | None = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy of a collated causal-LM batch (padded or packed).

    `batch` holds `input_ids` and `labels` [rows, seq] (labels aligned with inputs, -100 where
    there is no loss) and either `attention_mask` (padded) or `position_ids` (packed).
    `chunk_logits`: largest number of logits computed at once. `route` forces "split", "hook"
    or "full" (tests); by default the best route the model passed is used.
    Returns a 0-dim fp32 tensor, the sum (the caller divides by the step's loss tokens).
    """
    checks = check_model(model, batch["input_ids"])
    if "position_ids" in batch and not checks.packing_exact:
        batch = unpack(batch)
    labels = batch["labels"][:, 1:]  # position t predicts token t + 1
    keep = labels != IGNORE  # [rows, seq - 1]
    targets = labels[keep]  # [loss_tokens]
    inputs = forward_inputs(batch, checks.packed_attention)
    route = route or checks.route
    if route == "split":
        body, head = checks.parts or lm_parts(model)  # type: ignore[misc]
        hidden = body(**inputs)[0]  # [rows, seq, hidden]
        return cross_entropy_sum(head, gather_rows(hidden, keep), targets, chunk_logits)
    if route == "hook":
        head = _unwrap(model).get_output_embeddings()

        def gather(_module: torch.nn.Module, args: tuple) -> tuple | None:
            if args and args[0].dim() == 3:  # [rows, seq, hidden] -> [loss_tokens, hidden]
                return (args[0][:, :-1][keep], *args[1:])
            return None

        handle = head.register_forward_pre_hook(gather)
        try:
            logits = model(**inputs).logits
        finally:
            handle.remove()
        if logits.dim() == 3:  # the head was not called on the hidden states as expected
            logits = logits[:, :-1][keep]
        return F.cross_entropy(logits.float(), targets, reduction="sum")
    logits = model(**inputs).logits  # [rows, seq, vocab]
    return F.cross_entropy(logits[:, :-1][keep].float(), targets, reduction="sum")


def gather_rows(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Hidden states [rows, seq, hidden] at the positions `keep` [rows, seq - 1] marks, as
    [n, hidden], in the order of `labels[:, 1:][keep]` (one index_select: its backward is a
    single index_add)."""
    rows, seq = hidden.shape[:2]
    index = (keep.nonzero() * torch.tensor([seq, 1], device=keep.device)).sum(1)
    return hidden.reshape(rows * seq, -1).index_select(0, index)


def cross_entropy_sum(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_logits: int = CHUNK_LOGITS,
) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` [n, vocab] against `targets` [n].

    Above `chunk_logits` logits, rows go through the head in chunks under activation
    checkpointing: each chunk's logits are freed after its loss and recomputed in backward.
    """
    vocab = _out_features(head)
    n = hidden.shape[0]
    if vocab is None or n * vocab <= chunk_logits:
        return F.cross_entropy(head(hidden).float(), targets, reduction="sum")
    rows = max(1, chunk_logits // vocab)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        total = total + checkpoint(
            _chunk_loss, head, hidden[part], targets[part], use_reentrant=False
        )
    return total


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor):
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def _out_features(head: torch.nn.Module) -> int | None:
    if isinstance(getattr(head, "out_features", None), int):
        return head.out_features
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def forward_inputs(batch: dict[str, torch.Tensor], packed_attention: bool) -> dict[str, Any]:
    """Keyword arguments for the model's forward on `batch`, without labels and with no cache.

    A packed batch (one with `position_ids`) passes positions, plus `tunelab_segments` when
    `packed_attention` so attention stays inside each example; a padded one passes its mask.
    """
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False}
    if "position_ids" in batch:  # packed: attention stays inside each example
        inputs["position_ids"] = batch["position_ids"]
        if packed_attention:
            inputs["tunelab_segments"] = segment_bounds(batch["position_ids"])
    else:
        inputs["attention_mask"] = batch["attention_mask"]
    return inputs


# ------------------------------------------------------------------ routes


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP (`.module`) and peft (`get_base_model()`)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _is_wrapped(model: torch.nn.Module) -> bool:
    """DDP or FSDP: its forward must run (gradient sync, parameter gathering)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _prompt_learning(model: torch.nn.Module) -> bool:
    """peft prompt/prefix tuning: its forward injects virtual tokens the body alone would miss."""
    cfg = getattr(model, "peft_config", None)
    active = getattr(model, "active_adapter", None)
    if not isinstance(cfg, dict) or not isinstance(active, str) or active not in cfg:
        return False
    return bool(getattr(cfg[active], "is_prompt_learning", False))


# config fields of models that transform the logits after the head (soft-capping, scaling)
POST_HEAD_FIELDS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
)


def lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder body, LM head) of a plain or peft causal LM; None when not separable or when
    the model's config declares a transformation of the logits after the head."""
    if _is_wrapped(model) or _prompt_learning(model):
        return None
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if any(getattr(config, name, None) is not None for name in POST_HEAD_FIELDS):
        return None
    get_decoder = getattr(inner, "get_decoder", None)
    get_head = getattr(inner, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    try:
        body, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(body, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return None
    if body is inner:
        return None
    return body, head


def check_model(model: torch.nn.Module, input_ids: torch.Tensor) -> ModelChecks:
    """The route and the packing of `model`, checked on its first batch, then remembered.

    Three forward passes on 11 tokens of `input_ids` (no gradient, eval mode, no autocast, no
    randomness consumed): two sequences as a padded batch of 2 rows (the reference), the same
    two packed in one row, and the decoder body alone on the padded batch. A model on "sdpa" is
    switched to per-example attention first and back to "sdpa" if packing is then not exact.
    Warns once when packing cannot be exact (its packed batches are then unpacked).
    """
    checks = _CHECKS.get(model)
    if checks is None:
        checks = _CHECKS[model] = _run_checks(model, input_ids)
        if not checks.packing_exact:
            warnings.warn(
                f"{type(_unwrap(model)).__name__} lets packed examples attend to each other "
                "(its attention ignores position_ids restarts); training.packing is ignored and "
                "batches are padded instead",
                stacklevel=3,
            )
    return checks


def choose_route(model: torch.nn.Module, input_ids: torch.Tensor) -> str:
    """ "split", "hook" or "full" for `model` (see `check_model`)."""
    return check_model(model, input_ids).route


def packing_is_exact(model: torch.nn.Module, input_ids: torch.Tensor) -> bool:
    """Whether `model` keeps packed examples apart (see `check_model`)."""
    return check_model(model, input_ids).packing_exact


def _run_checks(model: torch.nn.Module, input_ids: torch.Tensor) -> ModelChecks:
    ids = _probe_ids(input_ids, 11)  # [1, 11]: sequences of 5 and 6 tokens
    padded = torch.cat([torch.cat([ids[:, :5], ids[:, :1]], dim=1), ids[:, 5:]])  # [2, 6]
    mask = torch.ones_like(padded)
    mask[0, 5] = 0
    positions = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0).to(ids.device)
    packed = {"input_ids": ids, "position_ids": positions}
    inner = _unwrap(model)
    packed_attention = use_packed_sdpa(inner)
    parts = lm_parts(model) if _has_head(model) else None
    with _Probe(model, ids.device):
        reference = model(input_ids=padded, attention_mask=mask, use_cache=False).logits
        apart = torch.cat([reference[0, :5], reference[1]])  # [11, vocab]
        exact = _close(apart, model(**forward_inputs(packed, packed_attention)).logits[0])
        if not exact and packed_attention:
            restore_sdpa(inner)
            packed_attention = False
            exact = _close(apart, model(**forward_inputs(packed, False)).logits[0])
        split = False
        if parts is not None:
            body, head = parts
            logits = head(body(input_ids=padded, attention_mask=mask, use_cache=False)[0])
            split = _close(reference[0, :5], logits[0, :5]) and _close(reference[1], logits[1])
    route = "split" if split else "hook" if _has_head(model) else "full"
    return ModelChecks(route, parts if split else None, exact, packed_attention)


def _has_head(model: torch.nn.Module) -> bool:
    try:
        return isinstance(_unwrap(model).get_output_embeddings(), torch.nn.Module)
    except (AttributeError, NotImplementedError):
        return False


def _probe_ids(input_ids: torch.Tensor, n: int = 12) -> torch.Tensor:
    """`n` token ids from the batch itself (valid for this vocabulary), [1, n]."""
    flat = input_ids.reshape(-1)
    reps = -(-n // flat.numel())
    return flat.repeat(reps)[:n].unsqueeze(0)


class _Probe:
    """No gradient, eval mode (no dropout), no autocast; the training mode is restored."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device

    def __enter__(self) -> None:
        self.was_training = self.model.training
        self.model.eval()
        self.stack = [torch.no_grad(), torch.autocast(self.device.type, enabled=False)]
        for c in self.stack:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.stack):
            c.__exit__(*exc)
        self.model.train(self.was_training)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of the parameters' dtype, relative to the logits' scale."""
    rel = 1e-4 if a.dtype == torch.float32 else 2e-2
    a, b = a.float(), b.float()
    return a.shape == b.shape and float((a - b).abs().max()) <= rel * (1.0 + float(a.abs().max()))


def unpack(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A packed batch (one row, positions restarting per example) as a right-padded batch."""
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    out_ids, out_labels, lengths = [], [], []
    for row in range(ids.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for s, e in zip(starts[:-1], starts[1:], strict=True):
            out_ids.append(ids[row, s:e])
            out_labels.append(labels[row, s:e])
            lengths.append(e - s)
    width = max(lengths)
    padded_ids = ids.new_zeros((len(lengths), width))
    padded_labels = labels.new_full((len(lengths), width), IGNORE)
    mask = ids.new_zeros((len(lengths), width))
    for i, n in enumerate(lengths):
        padded_ids[i, :n], padded_labels[i, :n], mask[i, :n] = out_ids[i], out_labels[i], 1
    out = {"input_ids": padded_ids, "labels": padded_labels, "attention_mask": mask}
    if "num_tokens" in batch:
        out["num_tokens"] = batch["num_tokens"]
    return out
