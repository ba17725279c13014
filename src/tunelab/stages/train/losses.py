"""The causal-LM loss, computed only where it counts.

Two things make a step of supervised fine-tuning cheaper without changing its result:

- Logits only at loss positions, fused with the cross-entropy. The LM head (hidden -> vocabulary)
  is the largest matmul of a small model, and with completion-only loss most positions (the
  prompt) need no logits. The decoder body runs on every token; its hidden states are gathered
  at the loss positions BEFORE the head, so the head projects `[loss_tokens, hidden]` instead of
  `[batch, seq, hidden]`. A plain linear head then goes through `linear_cross_entropy_sum`:
  chunk by chunk, logits, loss and their gradients in one pass, so no more than one chunk of
  `[rows, vocab]` logits ever exists and none is kept for backward (Liger Kernel's fused kernel
  does it on CUDA when installed). Another head (LoRA on `lm_head`) runs in chunks whose logits
  are recomputed in backward.
- Padding-free batches (`collate(..., packing=True)`): several examples in one row, positions
  restarting at 0 per example, no attention mask; transformers (sdpa, eager, flash) keeps
  attention inside each example when `use_cache=False`, and a model on "sdpa" is switched to a
  packed route of `tunelab.stages.train.attention` (FlashAttention varlen, torch varlen, FlexAttention
  or per-example SDPA), which skips the work of the block mask.

Both are exact, and both are checked on the model itself once (`check_model`: a few tokens, no
gradient, no randomness used) before they are relied on: the split body + head must reproduce
the model's own logits (a model that rescales or soft-caps logits after its head fails that, or
declares it in its config, and gets the head applied inside its own forward instead), and a
packed pair of sequences must give the logits of the same pair as a padded batch (a model that
lets packed examples see each other fails that and its packed batches are unpacked into padded
ones, with a warning). The packing check runs in the precision training uses (the autocast
around the first call), so a route that needs bf16 is checked in bf16.

Routes, best first:
- split: `body(...)` -> gather -> `head` -> fused (or chunked) cross-entropy. A plain model or a peft
  model (`PeftModel -> base_model.model -> get_decoder()` and `get_output_embeddings()`; a head
  adapted by LoRA is a module like any other and is applied whole to the gathered rows).
- hook: the model's own forward with a pre-hook on its output embeddings that gathers the
  hidden states; for models wrapped by DDP or FSDP (their forward must run for gradient sync and
  parameter gathering) and models whose forward transforms the logits after the head.
- full: full logits, then the loss positions (a model without output embeddings).

Interface: `causal_lm_loss_sum(model, batch, chunk_logits=None) -> Tensor` (the causal-LM branch of
`loop.loss_sum`), `linear_cross_entropy_sum(hidden, weight, bias, targets, chunk_rows=None)`
(chunks of `fused_chunk_rows(vocab)`), `cross_entropy_sum(head, hidden, targets,
chunk_logits=None)` (fused, or chunked above `CHUNK_LOGITS`; `cross_entropy_kind(head, device)`
says which). `check_model(model, input_ids, attention_route="auto") -> ModelChecks(route, parts,
packing_exact, packed_attention, attention, attention_tried, cross_entropy)` runs once per
model (the run calls it at its start, inside the training's autocast; else the first batch
does); `.describe()` is what compute.json records, `checks_of(model)` returns it later. A route
named by `training.attention` that cannot run or is not exact raises ConfigError.
"""

from __future__ import annotations

import importlib.util
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tunelab.stages.train import attention

IGNORE = -100
CHUNK_LOGITS = 1 << 26  # logits per recomputed chunk of a head that is not fused (256 MB fp32)
FUSED_CHUNK_LOGITS = 1 << 22  # logits per chunk of the fused loss (16 MB fp32) ...
FUSED_MIN_ROWS = 256  # ... but never fewer rows: small matmuls waste a GPU


@dataclass(frozen=True)
class ModelChecks:
    """What the checks found for one model (see the module doc)."""

    route: str  # "split" | "hook" | "full"
    parts: tuple[torch.nn.Module, torch.nn.Module] | None  # (body, head) on the split route
    packing_exact: bool
    packed_attention: bool  # a route of tunelab.stages.train.attention is in use
    # a route of tunelab.stages.train.attention, "block_mask" (transformers' own), "unpacked" (packed
    # batches padded again) or "model" (an attention other than sdpa, left as it is)
    attention: str = "block_mask"
    attention_tried: tuple[dict[str, str], ...] = ()  # [{route, reason}] of the routes not used
    cross_entropy: str = "chunked"  # "fused" | "liger" | "chunked" | "model"

    def describe(self) -> dict[str, Any]:
        """What a run records: the routes chosen and why the better ones were not."""
        return {
            "loss_route": self.route,
            "cross_entropy": self.cross_entropy,
            "packing_exact": self.packing_exact,
            "attention": self.attention,
            "attention_not_used": list(self.attention_tried),
        }


_CHECKS: weakref.WeakKeyDictionary[torch.nn.Module, ModelChecks] = weakref.WeakKeyDictionary()


def causal_lm_loss_sum(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    chunk_logits: int | None = None,
    route: str | None = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy of a collated causal-LM batch (padded or packed).

    `batch` holds `input_ids` and `labels` [rows, seq] (labels aligned with inputs, -100 where
    there is no loss) and either `attention_mask` (padded) or `position_ids` (packed).
    `chunk_logits`: largest number of logits computed at once (None: each path's own, see
    `cross_entropy_sum`). `route` forces "split", "hook"
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
    chunk_logits: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `head(hidden)` [n, vocab] against `targets` [n].

    A plain linear head: fused (`linear_cross_entropy_sum`, in chunks of `chunk_logits` logits,
    by default `fused_chunk_rows`; or Liger's kernel on CUDA). Another head: above
    `chunk_logits` logits (default CHUNK_LOGITS), rows go through it in chunks under activation
    checkpointing: each chunk's logits are freed after its loss and recomputed in backward.
    """
    kind = cross_entropy_kind(head, hidden.device)
    if kind == "liger" and chunk_logits is None:
        return _liger_sum(head, hidden, targets)
    if kind in ("fused", "liger"):
        rows = None if chunk_logits is None else max(1, chunk_logits // head.out_features)
        return linear_cross_entropy_sum(hidden, head.weight, head.bias, targets, rows)
    chunk_logits = chunk_logits or CHUNK_LOGITS
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


def cross_entropy_kind(head: torch.nn.Module, device: torch.device) -> str:
    """ "liger" (CUDA, liger_kernel installed), "fused" (a plain nn.Linear head) or "chunked"."""
    if type(head) is not torch.nn.Linear:
        return "chunked"
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        return "liger"
    return "fused"


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor):
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """sum(cross_entropy(hidden @ weight.T + bias, targets)) without the [n, vocab] logits.

    hidden [n, hidden], weight [vocab, hidden], bias [vocab] or None, targets [n]. Rows go in
    chunks of `chunk_rows` (None: `fused_chunk_rows(vocab)`); each chunk's logits are made in
    the compute dtype (the autocast dtype when autocast is on, as `F.linear` would), lifted to
    fp32 for the softmax,
    and turned at once into the gradients of `hidden`, `weight` and `bias` (softmax minus the
    one-hot target, through the head), which backward only scales. So no logits are kept for
    backward and no matmul is repeated. Returns a 0-dim fp32 tensor.
    """
    needs = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    rows = chunk_rows or fused_chunk_rows(weight.shape[0])
    if torch.is_grad_enabled() and any(needs):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, rows)
    with torch.no_grad():
        return _linear_ce_chunks(hidden, weight, bias, targets, rows, (False,) * 3)[0]


def fused_chunk_rows(vocab: int) -> int:
    """Rows per chunk of the fused loss: FUSED_CHUNK_LOGITS logits, at least FUSED_MIN_ROWS."""
    return max(FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows):  # noqa: ANN001, ANN205
        needs = tuple(ctx.needs_input_grad[:3])
        loss, *grads = _linear_ce_chunks(hidden, weight, bias, targets, rows, needs)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.present = tuple(g is not None for g in grads)
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) * grad_output if present else None for present in ctx.present]
        return (*grads, None, None)


def _linear_ce_chunks(hidden, weight, bias, targets, rows, needs):  # noqa: ANN001, ANN202
    """(loss, grad hidden, grad weight, grad bias) for `linear_cross_entropy_sum`; a gradient
    is None where `needs` says it is not wanted. Gradients are of the unscaled sum."""
    kind = hidden.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    n = hidden.shape[0]
    with torch.autocast(kind, enabled=False):
        w = weight.to(dtype)  # [vocab, hidden], the copy autocast would make
        b = bias.to(dtype) if bias is not None else None
        grad_h = torch.empty_like(hidden) if needs[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if needs[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            h = hidden[part].to(dtype)  # [r, hidden]
            loss, probs = _fused_chunk(h, targets[part], w, b, want=any(needs))
            total += loss
            if probs is None:
                continue
            g = probs.to(dtype)  # d loss / d logits in the compute dtype, as autocast's backward
            if grad_h is not None:
                grad_h[part] = g @ w
            if grad_w is not None:
                grad_w += (g.t() @ h).float()
            if grad_b is not None:
                grad_b += probs.sum(0)
            del probs, g  # before the next chunk's logits exist: one chunk alive at a time
    grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
    grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
    return total, grad_h, grad_w, grad_b


def _fused_chunk(h, t, w, b, want: bool):  # noqa: ANN001, ANN202
    """(summed loss, softmax minus one-hot [r, vocab] fp32 or None) of one chunk; the logits
    become the softmax in place, so one [r, vocab] fp32 buffer is all it holds."""
    logits = F.linear(h, w, b).float()  # [r, vocab]
    picked = logits.gather(1, t.unsqueeze(1))  # [r, 1]
    top = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(top).exp_()
    norm = probs.sum(dim=1, keepdim=True)
    loss = (norm.log() + top - picked).sum()  # log-sum-exp - target logit
    if not want:
        return loss, None
    probs.div_(norm)
    probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0
    return loss, probs


def _liger_sum(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    kind = hidden.device.type
    weight, bias = head.weight, head.bias
    if torch.is_autocast_enabled(kind):  # Liger computes in its inputs' dtype
        dtype = torch.get_autocast_dtype(kind)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    loss = liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="sum")
    return loss.float()


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
            inputs["tunelab_segments"] = attention.segment_bounds(batch["position_ids"])
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


def check_model(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_route: str = "auto"
) -> ModelChecks:
    """The route, the packing and the packed attention of `model`, checked on its first batch,
    then remembered.

    Forward passes on 11 tokens of `input_ids` (no gradient, eval mode, no randomness consumed):
    two sequences as a padded batch of 2 rows in fp32 (the reference), the decoder body alone on
    it, the same batch in the training's precision when autocast is on around this call, and
    the two sequences packed in one row with each candidate attention route
    (`tunelab.stages.train.attention.candidates` for `attention_route`: "auto" or one route) until one
    equals the reference as closely as the padded batch does in that precision. Then
    transformers' block mask; warns once when packing cannot be exact (its packed batches are
    then unpacked). A route asked by name that cannot run or is not exact raises ConfigError.
    """
    checks = _CHECKS.get(model)
    if checks is None:
        checks = _CHECKS[model] = _run_checks(model, input_ids, attention_route)
        if not checks.packing_exact:
            warnings.warn(
                f"{type(_unwrap(model)).__name__} lets packed examples attend to each other "
                "(its attention ignores position_ids restarts); training.packing is ignored and "
                "batches are padded instead",
                stacklevel=3,
            )
    return checks


def checks_of(model: torch.nn.Module) -> ModelChecks | None:
    """What `check_model` found for `model`, or None before its first check."""
    return _CHECKS.get(model)


def choose_route(model: torch.nn.Module, input_ids: torch.Tensor) -> str:
    """ "split", "hook" or "full" for `model` (see `check_model`)."""
    return check_model(model, input_ids).route


def packing_is_exact(model: torch.nn.Module, input_ids: torch.Tensor) -> bool:
    """Whether `model` keeps packed examples apart (see `check_model`)."""
    return check_model(model, input_ids).packing_exact


def _run_checks(model: torch.nn.Module, input_ids: torch.Tensor, requested: str) -> ModelChecks:
    ids = _probe_ids(input_ids, 11)  # [1, 11]: sequences of 5 and 6 tokens
    padded = torch.cat([torch.cat([ids[:, :5], ids[:, :1]], dim=1), ids[:, 5:]])  # [2, 6]
    mask = torch.ones_like(padded)
    mask[0, 5] = 0
    positions = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0).to(ids.device)
    packed = {"input_ids": ids, "position_ids": positions}
    device = ids.device
    amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    parts = lm_parts(model) if _has_head(model) else None
    with _Probe(model, device):
        reference = model(input_ids=padded, attention_mask=mask, use_cache=False).logits
        apart = torch.cat([reference[0, :5], reference[1]])  # [11, vocab]
        split = False
        if parts is not None:
            body, head = parts
            logits = head(body(input_ids=padded, attention_mask=mask, use_cache=False)[0])
            split = _close(reference[0, :5], logits[0, :5]) and _close(reference[1], logits[1])
        noise = 0.0  # how far the training's precision moves the padded logits
        if amp is not None:
            with torch.autocast(device.type, dtype=amp):
                low = model(input_ids=padded, attention_mask=mask, use_cache=False).logits
            noise = float((torch.cat([low[0, :5], low[1]]).float() - apart).abs().max())
        choice = _choose_attention(model, packed, apart, noise, amp, requested)
    route = "split" if split else "hook" if _has_head(model) else "full"
    head = parts[1] if split and parts is not None else None
    kind = cross_entropy_kind(head, device) if head is not None else "model"
    attention_name, tried, exact = choice
    packed_attention = attention_name in attention.ROUTES
    return ModelChecks(
        route,
        parts if split else None,
        exact,
        packed_attention,
        attention_name,
        tuple(tried),
        kind,
    )


def _choose_attention(
    model: torch.nn.Module,
    packed: dict[str, torch.Tensor],
    apart: torch.Tensor,
    noise: float,
    amp: torch.dtype | None,
    requested: str,
) -> tuple[str, list[dict[str, str]], bool]:
    """(attention, [{route, reason}] of the routes not used, packing exact) for `_run_checks`."""
    from tunelab.core.errors import ConfigError

    inner = _unwrap(model)
    device = apart.device

    def packed_logits(segmented: bool) -> torch.Tensor:
        with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            return model(**forward_inputs(packed, segmented)).logits[0]

    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if impl != "sdpa" and attention.route_of(inner) is None:  # eager, flash, ...: as it is
        if requested != "auto":
            raise ConfigError(
                f"training.attention: {requested} needs a model on sdpa attention; this one "
                f"runs {impl!r}",
                hint="use training.attention: auto",
            )
        out = packed_logits(False)
        if _close(apart, out, noise):
            return "model", [], True
        diff = float((out.float() - apart).abs().max())
        why = f"its {impl} attention lets packed examples see each other (logits differ by {diff:.3g})"
        return "unpacked", [{"route": str(impl), "reason": why}], False
    dtype = amp or next(inner.parameters()).dtype
    routes, tried = attention.candidates(requested, device, dtype)
    for route in routes:
        if not attention.use_route(inner, route):
            tried.append({"route": route, "reason": "the model cannot switch its attention"})
            continue
        try:
            out = packed_logits(True)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is skipped
            tried.append({"route": route, "reason": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        if _close(apart, out, noise):
            return route, tried, True
        diff = float((out.float() - apart).abs().max())
        tried.append({"route": route, "reason": f"packed logits differ from padded by {diff:.3g}"})
    attention.restore_sdpa(inner)
    if requested != "auto":
        raise ConfigError(
            f"training.attention: {requested} does not keep packed examples apart on this model "
            f"({tried[-1]['reason']})",
            hint="use training.attention: auto",
        )
    exact = _close(apart, packed_logits(False), noise)
    return ("block_mask" if exact else "unpacked"), tried, exact


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
    """No gradient, eval mode (no dropout), no autocast (each pass in the training's precision
    enters its own); the training mode is restored."""

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


def _close(a: torch.Tensor, b: torch.Tensor, noise: float = 0.0) -> bool:
    """Equal up to the rounding of the parameters' dtype, relative to the logits' scale, or
    within twice `noise` (how far the padded batch itself moves in a lower precision)."""
    rel = 1e-4 if a.dtype == torch.float32 else 2e-2
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False
    return float((a - b).abs().max()) <= max(rel * (1.0 + float(a.abs().max())), 2 * noise)


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
