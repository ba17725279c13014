"""Mixture-of-experts shapes read from a config.json: experts, top-k, total and active parameters.

A token runs through the router and `top_k` of the `experts` of each sparse layer (plus the
shared experts where the family has them), so an MoE model holds far more parameters than one
token computes with: Qwen3-30B-A3B holds about 30.5 B and activates about 3.3 B. Memory must
hold every expert; FLOPs follow the active parameters.

`moe_shape(config) -> MoeShape | None` (None for a dense model). The counts are a formula over
the config, one per family that transformers 5.24 builds with fused expert tensors
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`): Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, Granite-MoE (and its shared-expert variant), gpt-oss, DeepSeek-V3 (shared
experts, dense first layers, multi-head latent attention). transformers offers no parameter
count without building the model; the suite pins each formula to `sum(p.numel())` of a tiny
model of the family built by transformers (tests/test_moe.py). "Active" counts every parameter
a token's forward reads: the embedding matrix and the head whole (as model cards do), the
router, the shared experts, and `top_k` experts of each sparse layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> (experts key, expert intermediate key, router path in the parameter names)
_FAMILIES = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
    "granitemoe": ("num_local_experts", "intermediate_size"),
    "granitemoeshared": ("num_local_experts", "intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size"),
}
MOE_FAMILIES = tuple(_FAMILIES)


@dataclass(frozen=True)
class MoeShape:
    """The expert layout of an MoE config and its parameter counts."""

    model_type: str
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int  # the shared experts' MLP width (0: none)
    sparse_layers: tuple[int, ...]  # blocks whose MLP is routed (the others are dense)
    dense_intermediate: int  # the MLP width of the dense blocks
    total_params: int
    active_params: int
    expert_params: int  # every expert of every sparse layer
    router_params: int
    expert_biases: bool  # gpt-oss: bias tensors per expert
    router_logits_kept: bool  # output_router_logits: the auxiliary loss keeps every layer's
    hidden: int = 0

    @property
    def params_per_expert(self) -> int:
        h, i = self.hidden, self.expert_intermediate
        return 3 * h * i + (2 * i + h if self.expert_biases else 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "experts": self.experts,
            "top_k": self.top_k,
            "expert_intermediate": self.expert_intermediate,
            "shared_intermediate": self.shared_intermediate,
            "sparse_layers": list(self.sparse_layers),
            "dense_intermediate": self.dense_intermediate,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "expert_params": self.expert_params,
            "router_params": self.router_params,
            "expert_biases": self.expert_biases,
            "router_logits_kept": self.router_logits_kept,
            "hidden": self.hidden,
        }


def is_moe_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") in _FAMILIES and int(_experts(config) or 0) > 1


def _experts(config: dict[str, Any]) -> int | None:
    # the family's own key first (as its config.json spells it), then the other spellings a
    # saved config may carry (transformers maps Qwen3-MoE's num_experts to num_local_experts)
    key = _FAMILIES.get(config.get("model_type", ""), ("num_experts", ""))[0]
    for k in (key, "num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(k) is not None:
            return int(config[k])
    return None


def _sparse_layers(config: dict[str, Any]) -> tuple[int, ...]:
    layers = int(config["num_hidden_layers"])
    kind = config["model_type"]
    if kind == "deepseek_v3":
        first = int(config.get("first_k_dense_replace") or 0)
        every = int(config.get("moe_layer_freq") or 1)
        return tuple(i for i in range(first, layers) if i % every == 0)
    if kind in ("qwen3_moe", "qwen2_moe"):
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or [])
        return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return tuple(range(layers))


def _attention_params(config: dict[str, Any]) -> int:
    """One block's attention: projections, their biases, q/k norms, sinks."""
    kind, h = config["model_type"], int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    if kind == "deepseek_v3":
        rope, nope = int(config["qk_rope_head_dim"]), int(config["qk_nope_head_dim"])
        v, kv_rank = int(config["v_head_dim"]), int(config["kv_lora_rank"])
        q_rank = config.get("q_lora_rank")
        qk = heads * (nope + rope)
        q = h * int(q_rank) + int(q_rank) + int(q_rank) * qk if q_rank else h * qk
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * h
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    q, kv = heads * hd, kv_heads * hd
    out = h * q + 2 * h * kv + q * h
    if kind == "qwen2_moe" or config.get("qkv_bias"):
        out += q + 2 * kv
    if config.get("attention_bias"):
        out += q + 2 * kv + h
    if kind == "qwen3_moe":
        out += 2 * hd  # q_norm, k_norm over one head
    if kind == "olmoe":
        out += q + kv  # q_norm, k_norm over all heads
    if kind == "gpt_oss":
        out += heads  # attention sinks
    return out


def _shared_intermediate(config: dict[str, Any]) -> int:
    kind = config["model_type"]
    if kind == "qwen2_moe":
        return int(config.get("shared_expert_intermediate_size") or 0)
    if kind == "granitemoeshared":
        return int(config.get("shared_intermediate_size") or 0)
    if kind == "deepseek_v3":
        return int(config.get("moe_intermediate_size")) * int(config.get("n_shared_experts") or 0)
    return 0


def moe_shape(config: dict[str, Any]) -> MoeShape | None:
    """The expert layout and parameter counts of a config.json, or None for a dense model."""
    if not is_moe_config(config):
        return None
    kind = config["model_type"]
    h, layers, vocab = (
        int(config["hidden_size"]),
        int(config["num_hidden_layers"]),
        int(config["vocab_size"]),
    )
    experts = int(_experts(config) or 0)
    top_k = int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 1)
    expert_i = int(config[_FAMILIES[kind][1]])
    dense_i = int(config.get("intermediate_size") or 0)
    sparse = _sparse_layers(config)
    shared_i = _shared_intermediate(config)
    biases = kind == "gpt_oss"
    per_expert = 3 * h * expert_i + (2 * expert_i + h if biases else 0)
    router = experts * h + (experts if biases else 0)
    shared = 3 * h * shared_i + (h if kind == "qwen2_moe" and shared_i else 0)
    block_fixed = _attention_params(config) + 2 * h
    dense_mlp = 3 * h * dense_i
    n_sparse = len(sparse)
    outside = vocab * h + h + (0 if config.get("tie_word_embeddings") else vocab * h)
    total = (
        layers * block_fixed
        + (layers - n_sparse) * dense_mlp
        + n_sparse * (experts * per_expert + router + shared)
        + outside
    )
    active = total - n_sparse * (experts - top_k) * per_expert
    return MoeShape(
        model_type=kind,
        experts=experts,
        top_k=top_k,
        expert_intermediate=expert_i,
        shared_intermediate=shared_i,
        sparse_layers=sparse,
        dense_intermediate=dense_i,
        total_params=total,
        active_params=active,
        expert_params=n_sparse * experts * per_expert,
        router_params=n_sparse * router,
        expert_biases=biases,
        router_logits_kept=bool(config.get("output_router_logits")),
        hidden=h,
    )
