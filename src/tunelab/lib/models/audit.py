"""The parameter audit: what trains, what stays frozen, how many bytes, what a checkpoint saves.

`parameter_audit` is pure bookkeeping over `model.named_parameters()` (the CLI renders it).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

PEFT_PREFIX = "base_model.model."
HEAD_NAMES = {"classifier", "score", "lm_head", "pre_classifier", "qa_outputs", "cls", "head"}
GROUP_ORDER = [
    "embeddings",
    "attention",
    "mlp",
    "experts",
    "router",
    "norm",
    "pooler",
    "head",
    "other",
    "lora_A",
    "lora_B",
    "lora_other",
]


def strip_wrappers(name: str) -> str:
    """A parameter name as in the plain transformers model (no peft or DDP prefixes/copies)."""
    if name.startswith("module."):
        name = name[len("module.") :]
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".modules_to_save.default.", ".").replace(".original_module.", ".")


def param_group(name: str) -> str:
    """The module group of a parameter: embeddings, attention, mlp, experts, router, norm,
    pooler, head, lora_*. Shared experts count as mlp (every token runs through them)."""
    if ".lora_A." in name or ".lora_embedding_A." in name:
        return "lora_A"
    if ".lora_B." in name or ".lora_embedding_B." in name:
        return "lora_B"
    if ".lora_" in name:
        return "lora_other"
    parts = strip_wrappers(name).lower().split(".")[:-1]
    if parts and parts[0] in HEAD_NAMES:
        return "head"
    # mixture of experts: the routed experts and the router apart from the dense MLP
    if "experts" in parts and not any(p.startswith("shared") for p in parts):
        return "experts"
    if parts and parts[-1] in ("router", "shared_expert_gate") or parts[-2:] == ["mlp", "gate"]:
        return "router"
    if any("norm" in p or p.startswith("ln_") for p in parts):
        return "norm"
    if any("embed" in p or p in ("wte", "wpe") for p in parts):
        return "embeddings"
    if "pooler" in parts:
        return "pooler"
    attention = {"attention", "self_attn", "attn", "self", "q_proj", "k_proj", "v_proj", "o_proj"}
    if any(p in attention or "attn" in p for p in parts):
        return "attention"
    mlp = {"mlp", "intermediate", "ffn", "feed_forward", "output", "gate_proj", "up_proj"}
    if any(p in mlp or p in ("down_proj", "fc1", "fc2", "c_fc") for p in parts):
        return "mlp"
    return "other"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def parameter_audit(
    model: Any,
    *,
    method: str,
    adapted_modules: list[str],
    modules_to_save: list[str],
    saves: str,
    extra: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """Counts per module group, totals, bytes by dtype and what will be saved."""
    groups: dict[str, dict[str, int]] = {}
    by_dtype: dict[str, dict[str, int]] = {}
    trainable = frozen = 0
    trainable_tensors = 0
    from tunelab.lib.models.quantize import quantized_numel

    for name, p in model.named_parameters():
        n = quantized_numel(p)  # a 4-bit tensor counts its weights, its bytes stay packed
        g = groups.setdefault(
            param_group(name), {"trainable": 0, "frozen": 0, "tensors_trainable": 0}
        )
        d = by_dtype.setdefault(_dtype_name(p.dtype), {"trainable": 0, "frozen": 0})
        kind = "trainable" if p.requires_grad else "frozen"
        g[kind] += n
        d[kind] += p.numel() * p.element_size()
        if p.requires_grad:
            trainable += n
            trainable_tensors += 1
            g["tensors_trainable"] += 1
        else:
            frozen += n
    total = trainable + frozen
    if saves == "model":
        saved_params = total
    else:
        saved_params = trainable
    audit: dict[str, Any] = {
        "method": method,
        "groups": {k: groups[k] for k in GROUP_ORDER if k in groups},
        "totals": {
            "trainable": trainable,
            "frozen": frozen,
            "all": total,
            "trainable_share": trainable / total if total else 0.0,
            "trainable_tensors": trainable_tensors,
        },
        "bytes_by_dtype": by_dtype,
        "adapted_modules": list(adapted_modules),
        "adapted_summary": summarize_modules(adapted_modules),
        "modules_to_save": list(modules_to_save),
        "saves": saves,
        "saved_params": saved_params,
    }
    audit.update(extra or {})
    audit["notes"] = list(notes or [])
    return audit


def summarize_modules(names: list[str]) -> str:
    """'q_proj x30, v_proj x30' for a list of module names (layer indices folded)."""
    if not names:
        return "none"
    counts = Counter(re.sub(r"\.\d+\.", ".*.", n).split(".")[-1] for n in names)
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(counts.items()))
