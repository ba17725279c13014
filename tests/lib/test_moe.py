"""Mixture-of-experts shapes: the config formula equals transformers' own parameter count on a
tiny model of each family, active equals what one token's forward touches, and a
Qwen3-30B-A3B-shaped study is planned with its experts resident and its active FLOPs."""

from __future__ import annotations

import json

import pytest
import torch

from tunelab.lib.models.moe import moe_shape

COMMON = {
    "vocab_size": 96,
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}
# one tiny config per family transformers builds here, each with what makes it special
TINY = {
    "qwen3_moe": {
        "intermediate_size": 40,
        "moe_intermediate_size": 8,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "mlp_only_layers": [1],
    },
    "qwen2_moe": {
        "intermediate_size": 40,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 12,
        "num_experts": 6,
        "num_experts_per_tok": 2,
    },
    "mixtral": {"intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 8, "num_experts": 6, "num_experts_per_tok": 2},
    "granitemoe": {"intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoeshared": {
        "intermediate_size": 8,
        "shared_intermediate_size": 12,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gpt_oss": {
        "intermediate_size": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        "intermediate_size": 40,
        "moe_intermediate_size": 8,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 8,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
    },
}


def tiny_moe(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **COMMON, **TINY[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return config.to_dict(), model


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_formula_equals_the_parameters_transformers_builds(model_type):
    config, model = tiny_moe(model_type)
    shape = moe_shape(config)
    assert shape is not None
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.expert_params == experts


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_active_is_what_one_token_touches(model_type):
    """One token forward and backward: every tensor that gets a gradient counts whole, except
    the fused expert tensors, which count only the experts with a non-zero gradient slice."""
    config, model = tiny_moe(model_type)
    shape = moe_shape(config)
    ids = torch.tensor([[7]])
    model(input_ids=ids, labels=ids).logits.sum().backward()
    touched = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".experts." in name:
            rows = p.grad.reshape(p.shape[0], -1).abs().sum(dim=1)
            touched += int((rows > 0).sum()) * p[0].numel()
        else:
            touched += p.numel()
    assert touched == shape.active_params
    assert shape.active_params < shape.total_params


# Qwen3-30B-A3B's published config.json (the values that shape the model)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16",
}


def test_qwen3_30b_a3b_counts():
    shape = moe_shape(QWEN3_30B_A3B)
    assert shape.total_params == 30_532_122_624
    assert shape.active_params == 3_353_032_704
    assert 30.4e9 < shape.total_params < 30.6e9 and 3.2e9 < shape.active_params < 3.4e9


def test_full_fine_tuning_flops_follow_the_active_parameters():
    from tunelab.core.config_training import AdaptationConfig
    from tunelab.stages.plan.flops import MicroBatch, micro_step_flops
    from tunelab.stages.plan.shapes import facts_from_config

    facts = facts_from_config(
        QWEN3_30B_A3B, AdaptationConfig(method="full"), architecture="causal_lm", dtype="bfloat16"
    )
    shape = moe_shape(QWEN3_30B_A3B)
    assert facts.num_params == facts.trainable_params == shape.total_params
    assert facts.total_weight_bytes == 2 * shape.total_params
    tokens = 1024
    flops = micro_step_flops(facts, MicroBatch(tokens, 0.0, tokens, 1), checkpointing=False).total
    # 6 FLOPs per active parameter per token (the embedding lookup is no matmul)
    matmul = shape.active_params - QWEN3_30B_A3B["vocab_size"] * 2048 - 48 * (2 * 2048 + 256)
    matmul -= 2048
    assert flops == pytest.approx(6 * matmul * tokens, rel=1e-6)
    assert flops < 0.2 * 6 * shape.total_params * tokens


def test_a_qwen3_30b_a3b_study_is_planned_with_its_experts_resident(tmp_path, capsys):
    from helpers import run_cli, write_config_only_study

    root = write_config_only_study(tmp_path / "a3b", QWEN3_30B_A3B, capsys, dtype="bfloat16")
    code, out, err = run_cli(capsys, "plan", "-s", root, "--compare-gpus", "--gpus", "1", "--json")
    assert code == 0, err
    result = json.loads(out[out.index("{") :])
    rows = {r["gpu"]: r for r in result["rows"]}
    # bf16 weights and the study's LoRA adapters (in fp32): every expert resident
    lora = 48 * 8 * (2 * (2048 + 4096) + 2 * (2048 + 512))  # rank 8 on q, k, v, o
    weights = (2 * 30_532_122_624 + 4 * lora) / 1e9
    for card in ("RTX-4090", "L4"):  # one card: the load itself does not fit
        assert not rows[card]["fits"]
        assert f"(weights {weights:.1f} GB, loaded whole on every rank)" in rows[card]["why_not"]
    model = next(i["value"] for i in result["inputs"] if i["name"] == "model")
    assert f"{30_532_122_624 + lora:,} parameters, {lora:,} trained" in model
    assert "3,353,032,704 active a token (8 of 128 experts)" in model
    code, out, err = run_cli(capsys, "plan", "-s", root, "--compare-gpus", "--gpus", "1")
    assert code == 0, err
    for card in ("RTX-4090", "L4"):
        assert f"{card}: does not fit at 1 GPU (load {weights:.1f} GB a GPU over 24 GB" in out
    # on 1/2/4/8 GPUs a node FSDP splits the experts: 32 of 128 on each of 4 GPUs
    code, out, err = run_cli(capsys, "plan", "-s", root, "--compare-gpus", "--json")
    assert code == 0, err
    result = json.loads(out[out.index("{") :])
    four = {r["gpu"]: r for r in result["layouts"] if (r["gpus"], r["strategy"]) == (4, "fsdp")}
    for card in ("RTX-4090", "H100-SXM"):
        assert four[card]["experts"] == "32 of 128 experts a layer on each GPU (FSDP)"
    # the training fits on 4 RTX-4090, but tunelab eval loads the whole model on one of them
    assert not four["RTX-4090"]["fits"] and "evaluation" in four["RTX-4090"]["why_not"]
    assert four["H100-SXM"]["fits"], four["H100-SXM"]["why_not"]
    assert "FSDP shards the experts' weights" in result["notes"][0]


def test_the_audit_groups_experts_and_router_and_says_lora_does_not_reach_them():
    from tunelab.core.config_training import AdaptationConfig
    from tunelab.lib.models.adapt import adapt

    _, model = tiny_moe("qwen3_moe")
    shape = moe_shape(model.config.to_dict())
    _, audit = adapt(model, AdaptationConfig(target_modules=["q_proj", "v_proj"]), "causal_lm")
    groups = audit["groups"]
    assert groups["experts"] == {
        "trainable": 0,
        "frozen": shape.expert_params,
        "tensors_trainable": 0,
    }
    assert groups["router"]["frozen"] == shape.router_params
    assert any("routed experts are fused parameters" in n for n in audit["notes"])
    _, full = tiny_moe("qwen3_moe")
    _, audit = adapt(full, AdaptationConfig(method="full"), "causal_lm")
    assert audit["groups"]["experts"]["trainable"] == shape.expert_params
    assert not any("fused" in n for n in audit["notes"])
