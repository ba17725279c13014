"""The memory model's `ModelFacts` of an adapted model from its config.json alone: no weights.

A study that has not loaded its model yet (a 1B-class base named only by its config) can be
planned from its architecture and the adaptation it registers. `model_facts` (sizing) reads
the same facts from a loaded, adapted model; for the Llama and BERT families the two agree.

`facts_from_config(config_json, adaptation, *, architecture, dtype, num_labels) -> ModelFacts`
(also for method qlora).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunelab.core.config_training import AdaptationConfig
from tunelab.core.errors import StudyError
from tunelab.lib.models.moe import moe_shape
from tunelab.stages.plan.flops import linear_shapes
from tunelab.stages.plan.moe_shapes import moe_facts
from tunelab.stages.sizing.facts import _BERT_TYPES, _LLAMA_TYPES
from tunelab.stages.sizing.memory import quant_constants_of
from tunelab.stages.sizing.terms import DTYPE_BYTES, ModelFacts

# target module names as peft matches them, per block family
_TARGETS = {
    "llama": {
        "q_proj": "q",
        "k_proj": "k",
        "v_proj": "v",
        "o_proj": "o",
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
    },
    "bert": {"query": "q", "key": "k", "value": "v"},
}


def read_model_config(folder: Path) -> dict[str, Any]:
    """The model folder's config.json. Raises StudyError when there is none."""
    path = folder / "config.json"
    if not path.is_file():
        raise StudyError(
            f"{path}: no config.json to plan from",
            hint="point model.path at a transformers folder (its config.json is enough to plan), "
            "or run `tunelab size`",
        )
    return json.loads(path.read_text())


def _lora_roles(family: str, targets: list[str] | str) -> set[str]:
    if targets == "all-linear":
        return set(_TARGETS[family].values()) | ({"o", "up", "down"} if family == "bert" else set())
    known = _TARGETS[family]
    unknown = [t for t in targets if t.split(".")[-1] not in known]
    if unknown:
        raise StudyError(
            f"adaptation.target_modules {unknown}: the planner knows {', '.join(known)} for a "
            f"{family}-like model",
            hint="run `tunelab size`: its facts come from the adapted model itself",
        )
    return {known[t.split(".")[-1]] for t in targets}


def _shape_facts(config: dict[str, Any], architecture: str, num_labels: int) -> ModelFacts:
    """The model's shape from its config.json, nothing trained yet."""
    family = "bert" if config.get("model_type", "") in _BERT_TYPES else "llama"
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    return ModelFacts(
        family=family,
        architecture=architecture,
        hidden=hidden,
        intermediate=int(config.get("intermediate_size", 4 * hidden)),
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab=int(config["vocab_size"]),
        num_labels=num_labels if architecture == "encoder" else 0,
    )


def _block_training(
    config: dict[str, Any],
    base: ModelFacts,
    shapes: dict[str, tuple[int, int]],
    roles: set[str],
    *,
    full: bool,
    rank: int,
    saved: int,
    pb: int,
) -> tuple[dict[str, str], int]:
    """(what trains in each block by role, the largest trainable tensor's bytes, weights of `pb`
    bytes each): every weight in full fine-tuning, else the LoRA adapters (float32, of `rank`)
    of `roles` and the saved head copy of `saved` parameters."""
    if full:
        rows = max(
            base.vocab,
            int(config.get("max_position_embeddings", 0)) if base.family == "bert" else 0,
        )
        largest = max(rows * base.hidden, *(i * o for i, o in shapes.values())) * pb
        return {role: "weight" for role in (*shapes, "norm1", "norm2")}, largest
    adapters = [rank * max(i, o) * 4 for role, (i, o) in shapes.items() if role in roles]
    return {role: "lora" for role in roles}, max([*adapters, saved * pb])


def facts_from_config(
    config: dict[str, Any],
    adaptation: AdaptationConfig,
    *,
    architecture: str,
    dtype: str = "float32",
    num_labels: int = 0,
) -> ModelFacts:
    """The facts `model_facts` would read from the adapted model (LoRA adapters in float32, as
    peft keeps them). Raises StudyError for a freeze adaptation (its trainable set is a list of
    name patterns: `tunelab size` reads it from the model)."""
    if adaptation.method == "freeze":
        raise StudyError(
            "a freeze adaptation is planned from the adapted model",
            hint="run `tunelab size` (it records the trainable parameters), then plan",
        )
    model_type = config.get("model_type", "")
    base = _shape_facts(config, architecture, num_labels)
    family, hidden, layers = base.family, base.hidden, base.layers
    moe = moe_shape(config)
    if moe is not None:
        return moe_facts(config, moe, base, adaptation, dtype)
    shapes = linear_shapes(base)
    full = adaptation.method == "full"
    tied = architecture == "causal_lm" and bool(config.get("tie_word_embeddings", False))
    dense, head = _dense_params(config, base, tied, num_labels)
    roles = set() if full else _lora_roles(family, adaptation.target_modules)
    r = adaptation.rank
    lora = sum(r * (i + o) for role, (i, o) in shapes.items() if role in roles) * layers
    pooler = None
    if family == "bert":
        pooler = (
            "weight" if full else ("lora" if adaptation.target_modules == "all-linear" else None)
        )
        lora += r * 2 * hidden if pooler == "lora" else 0
    # an encoder's new head trains beside LoRA: tunelab adds it to modules_to_save (a copy)
    saved = head if family == "bert" and not full else 0
    pb = DTYPE_BYTES[dtype]
    weight_bytes = {dtype: (dense + saved) * pb}
    if lora:
        weight_bytes["float32"] = weight_bytes.get("float32", 0) + lora * 4
    layer_roles, largest = _block_training(
        config, base, shapes, roles, full=full, rank=r, saved=saved, pb=pb
    )
    quant = _quantized(adaptation, shapes, layers, dtype, weight_bytes)
    dropout_key = "attention_probs_dropout_prob" if family == "bert" else "attention_dropout"
    return replace(
        base,
        tied_embeddings=tied,
        attention_dropout=float(config.get(dropout_key) or 0.0),
        hidden_dropout=float(config.get("hidden_dropout_prob") or 0.0) if family == "bert" else 0.0,
        param_dtype=quant.pop("param_dtype", dtype),
        weight_bytes=weight_bytes,
        num_params=dense + lora + saved,
        trainable_params=dense if full else lora + saved,
        trainable_bytes=dense * pb if full else lora * 4 + saved * pb,
        largest_trainable_bytes=largest,
        layer_training=tuple(dict(layer_roles) for _ in range(layers)),
        lora_rank=0 if full else r,
        lora_dropout=0.0 if full else adaptation.dropout,
        embed="weight" if full else None,
        final_norm="weight" if full and family == "llama" else None,
        pooler=pooler,
        head="weight" if full or saved else None,
        approximate=model_type not in _LLAMA_TYPES | _BERT_TYPES,
        **quant,
    )


def _quantized(
    adaptation: AdaptationConfig,
    shapes: dict[str, tuple[int, int]],
    layers: int,
    dtype: str,
    weight_bytes: dict[str, int],
) -> dict[str, Any]:
    """QLoRA: every block linear layer stored in 4 bits (moved out of `weight_bytes[dtype]`
    into packed uint8, in place), the other weights in fp32 (peft's
    prepare_model_for_kbit_training lifts them), and the ModelFacts fields that describe them."""
    if adaptation.method != "qlora":
        return {}
    from tunelab.lib.models.quantize import COMPUTE_DTYPES

    q = adaptation.quantization
    numels = [i * o for i, o in shapes.values()] * layers
    n = sum(numels)
    rest = weight_bytes.pop(dtype) // DTYPE_BYTES[dtype] - n
    weight_bytes["float32"] = weight_bytes.get("float32", 0) + rest * 4
    weight_bytes["uint8"] = weight_bytes.get("uint8", 0) + sum(-(-k // 2) for k in numels)
    return {
        "param_dtype": "float32",
        "quant_params": n,
        "quant_tensors": len(numels),
        "quant_constant_bytes": quant_constants_of(numels, q.double_quant),
        "quant_largest": max(numels),
        "quant_dtype": dtype,
        "quant_compute_dtype": COMPUTE_DTYPES[q.compute_dtype],
    }


def _dense_params(
    config: dict[str, Any], base: ModelFacts, tied: bool, num_labels: int
) -> tuple[int, int]:
    """(every parameter of the base model, those of an encoder's classification head)."""
    h, shapes = base.hidden, linear_shapes(base)
    per_block = sum(i * o for i, o in shapes.values())
    if base.family == "bert":
        per_block += 4 * h + base.intermediate + h  # biases
        per_block += 4 * h  # two LayerNorms
        positions = int(config.get("max_position_embeddings", 512))
        types = int(config.get("type_vocab_size", 2))
        outside = h * (base.vocab + positions + types) + 2 * h + h * h + h  # LayerNorm, pooler
        labels = max(1, num_labels)
        head = h * labels + labels
        return per_block * base.layers + outside + head, head
    qkv_bias = shapes["q"][1] + shapes["k"][1] + shapes["v"][1]
    if config.get("attention_bias"):
        per_block += qkv_bias + h
    elif config.get("model_type") == "qwen2":
        per_block += qkv_bias  # Qwen2 biases q, k and v, never o
    per_block += 2 * h  # RMSNorms
    outside = base.vocab * h + h  # embeddings, final norm
    return per_block * base.layers + outside + (0 if tied else base.vocab * h), 0
