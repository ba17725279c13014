"""The memory model's `ModelFacts` of a mixture-of-experts config.json, without weights.

Every expert is resident (weights, and under full fine-tuning their gradients and optimizer
states); the step's FLOPs follow the active parameters (`flops.block_linears`). LoRA reaches
the attention projections and the linear layers of the dense blocks and shared experts: peft
wraps `nn.Linear` modules, and transformers 5.24 keeps the routed experts as fused 3-D
parameters (`experts.gate_up_proj`), which `target_modules` names do not match; the audit says
so. A 4-bit (QLoRA) MoE base is planned from `tunelab size`, not from the config.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tunelab.core.config_training import AdaptationConfig
from tunelab.core.errors import StudyError
from tunelab.lib.models.moe import MoeShape
from tunelab.stages.sizing.terms import DTYPE_BYTES, ModelFacts

_ATTENTION = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# the families whose blocks the llama walk follows op for op (others: approximate)
WALKED = {"qwen3_moe", "mixtral", "olmoe", "granitemoe", "qwen2_moe", "granitemoeshared"}


def _lora_roles(targets: list[str] | str) -> set[str]:
    known = _ATTENTION | _MLP
    if targets == "all-linear":
        return set(known.values())
    unknown = [t for t in targets if t.split(".")[-1] not in known]
    if unknown:
        raise StudyError(
            f"adaptation.target_modules {unknown}: the planner knows {', '.join(known)} for a "
            "mixture-of-experts model (its routed experts are fused tensors LoRA does not reach)",
            hint="run `tunelab size`: its facts come from the adapted model itself",
        )
    return {known[t.split(".")[-1]] for t in targets}


def _lora_params(base: ModelFacts, shape: MoeShape, roles: set[str], rank: int) -> int:
    """Adapter weights: attention in every block, gate/up/down in dense blocks and shared
    experts (never in the fused routed experts)."""
    h, hd = base.hidden, base.head_dim
    q, kv = base.heads * hd, base.kv_heads * hd
    attention = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
    per_block = sum(rank * (i + o) for r, (i, o) in attention.items() if r in roles)
    mlp_roles = len(roles & {"gate", "up", "down"})
    dense = base.layers - len(shape.sparse_layers)
    mlp = mlp_roles * rank * (h + shape.dense_intermediate) * dense
    mlp += (
        mlp_roles
        * rank
        * (h + shape.shared_intermediate)
        * len(shape.sparse_layers)
        * bool(shape.shared_intermediate)
    )
    return per_block * base.layers + mlp


def _layer_roles(base: ModelFacts, shape: MoeShape, full: bool, roles: set[str]) -> tuple:
    out = []
    for i in range(base.layers):
        sparse = i in shape.sparse_layers
        if full:
            names = ["q", "k", "v", "o", "norm1", "norm2"]
            names += ["experts", "router"] + (["shared"] if shape.shared_intermediate else [])
            out.append(
                {r: "weight" for r in names}
                if sparse
                else {r: "weight" for r in (*names[:6], "gate", "up", "down")}
            )
        else:
            layer = {r: "lora" for r in roles & {"q", "k", "v", "o"}}
            mlp = roles & {"gate", "up", "down"}
            if mlp and (not sparse or shape.shared_intermediate):
                layer.update({"shared": "lora"} if sparse else {r: "lora" for r in mlp})
            out.append(layer)
    return tuple(out)


def moe_facts(
    config: dict[str, Any],
    shape: MoeShape,
    base: ModelFacts,
    adaptation: AdaptationConfig,
    dtype: str,
) -> ModelFacts:
    """`base` (the dense fields read from the config) completed for an MoE model."""
    if adaptation.method == "qlora":
        raise StudyError(
            "a 4-bit (QLoRA) mixture-of-experts base is planned from the adapted model: "
            "bitsandbytes quantizes linear layers, not the fused expert tensors",
            hint="run `tunelab size` (it records the model as loaded), then plan",
        )
    full = adaptation.method == "full"
    roles = set() if full else _lora_roles(adaptation.target_modules)
    r = adaptation.rank
    lora = 0 if full else _lora_params(base, shape, roles, r)
    total = shape.total_params
    pb = DTYPE_BYTES[dtype]
    weight_bytes = {dtype: total * pb}
    if lora:
        weight_bytes["float32"] = lora * 4
    expert_tensor = shape.experts * 2 * shape.expert_intermediate * base.hidden
    widest = max(base.hidden, base.heads * base.head_dim, shape.dense_intermediate)
    largest = max(base.vocab * base.hidden, expert_tensor) * pb if full else r * widest * 4
    return replace(
        base,
        intermediate=shape.dense_intermediate or base.intermediate,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        param_dtype=dtype,
        weight_bytes=weight_bytes,
        num_params=total + lora,
        trainable_params=total if full else lora,
        trainable_bytes=total * pb if full else lora * 4,
        largest_trainable_bytes=largest,
        layer_training=_layer_roles(base, shape, full, roles),
        lora_rank=0 if full else r,
        lora_dropout=0.0 if full else adaptation.dropout,
        embed="weight" if full else None,
        final_norm="weight" if full else None,
        head="weight" if full else None,
        approximate=shape.model_type not in WALKED,
        moe=shape.to_dict(),
    )
