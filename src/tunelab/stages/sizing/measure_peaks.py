"""The evaluation's peak, measured in the sizing's child process (`measure.run_configurations`
calls `measure_evaluation` for a spec whose `peak` is "evaluation").

The model is built as training builds it, adapted, in eval mode, without an optimizer. A small
run of the same code first (two rows, a few tokens) maps what the first call maps (kernels,
caches), so that `idle` holds it. Then, with the heap's free pages returned and the high-water
mark reset:

- generation: `generate` (KV cache, greedy) on `batch_size` rows of `seq_len` prompt tokens
  for exactly `max_new_tokens` new tokens (`min_new_tokens` too: an early EOS of a random or
  tuned model never shortens the measurement);
- a forward: one no-grad forward of a classifier at `batch_size` rows of `seq_len` tokens (an
  image model: `batch_size` images at the side or size the training uses), the head's logits
  and their softmax as `tunelab eval` computes them.

CPU: peak RSS (VmHWM) less the idle RSS; CUDA: `max_memory_allocated` less the allocated bytes
before. Out of memory (or the watchdog past the budget) is `does_not_fit`.
"""

from __future__ import annotations

from typing import Any

from tunelab.core.record_base import damaged
from tunelab.stages.sizing.child_model import (
    build_for,
    collect,
    image_side,
    is_oom,
    spec_of,
    synthetic_examples,
)
from tunelab.stages.sizing.process_memory import hwm_bytes, reset_hwm, rss_bytes


def _inputs(spec: dict[str, Any], base: Any, facts: Any, rows: int, length: int) -> dict[str, Any]:
    """A batch of `rows` synthetic rows of `length` tokens (or images), on the CPU."""
    import torch

    arch = base.architecture
    made = synthetic_examples(
        rows, length, arch, vocab=facts.vocab, seed=0,
        image_size=image_side({**spec, "seq_len": length}, base, facts) if arch == "image" else None,
    )  # fmt: skip
    if arch == "image":
        return {"pixel_values": torch.stack([e["pixel_values"] for e in made])}
    ids = torch.tensor([e["input_ids"] for e in made])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _run(model: Any, inputs: dict[str, Any], kind: str, new_tokens: int, device: Any) -> None:
    import torch

    from tunelab.lib.models.vision import pixels_for

    batch = {k: v.to(device) for k, v in inputs.items()}
    with torch.inference_mode():
        if kind == "generation":
            model.generate(
                **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                num_beams=1, use_cache=True, pad_token_id=0,
            )  # fmt: skip
            return
        if "pixel_values" in batch:
            batch["pixel_values"] = pixels_for(model, batch["pixel_values"])
        logits = model(**batch).logits
        torch.softmax(logits.float(), dim=-1)


def measure_evaluation(
    spec: dict[str, Any], device: Any, result: dict[str, Any]
) -> tuple[None, dict[str, Any]]:
    """(None, `result` with status and the measured figures) of the evaluation in `spec`:
    `evaluation {kind, batch_size, tokens, max_new_tokens}`."""
    import torch

    typed = spec_of(spec)
    ev = typed.evaluation_settings
    if ev is None:
        raise damaged(typed.path, "configuration: field 'evaluation' is missing")
    kind, rows, length = ev.kind, ev.batch_size, ev.tokens
    cfg, base, model, facts = build_for({**spec, "checkpointing": False}, device)
    result["facts"] = facts.to_dict()
    model.eval()
    cuda = device.type == "cuda"
    # the first call's one-time allocations, on a small batch
    first = 2 if base.architecture == "image" else min(length, 4)
    _run(model, _inputs(spec, base, facts, 2, first), kind, min(2, ev.max_new_tokens), device)
    inputs = _inputs(spec, base, facts, rows, length)
    collect(cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        idle = torch.cuda.memory_allocated(device)
    else:
        idle = rss_bytes()
    reset = reset_hwm()
    try:
        _run(model, inputs, kind, ev.max_new_tokens, device)
    except Exception as exc:  # noqa: BLE001 - out of memory is a verdict, anything else raises
        if is_oom(exc):
            return None, {**result, "status": "does_not_fit", "reason": f"{exc}"[:500]}
        raise
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = hwm_bytes() if reset else None
    measured = {
        "idle": idle,
        "peak_total": peak,
        "increase": (peak - idle) if peak is not None and idle is not None else None,
        "what": "max_allocated" if cuda else "peak RSS",
    }
    budget = typed.memory_budget_bytes
    if budget and peak and peak > budget:
        reason = f"peak {peak / 2**20:.0f} MiB above the budget"
        return None, {**result, "status": "does_not_fit", "reason": reason, "measured": measured}
    return None, {**result, "status": "ok", "measured": measured}
