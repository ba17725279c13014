"""The plan recommends only what loads: the load-time peak (tunelab.stages.sizing.load) on a
study that names a config.json of Llama-3-70B's shape and no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import FILLED_HYPOTHESIS, run_cli
from tunelab.core.config_training import AdaptationConfig
from tunelab.stages.plan.shapes import facts_from_config
from tunelab.stages.sizing.load import load_peak, load_problem

# Llama-3-70B's published config.json (the values that shape the model)
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LORA_ALL = AdaptationConfig(method="lora", target_modules="all-linear", rank=16)


def test_load_peak_whole_and_sharded():
    facts = facts_from_config(LLAMA_70B, LORA_ALL, architecture="causal_lm", dtype="bfloat16")
    weights = facts.total_weight_bytes
    assert 140e9 < weights < 142e9  # 70.6 B parameters in bf16
    for strategy in ("single", "ddp"):
        whole = load_peak(facts, strategy, 4, 4)
        assert whole.mode == "whole" and whole.device_per_rank == weights
        assert whole.host_per_node == 4 * weights if strategy == "ddp" else True
    sharded = load_peak(facts, "fsdp", 4, 4)
    assert sharded.mode == "sharded" and sharded.device_per_rank < weights / 4 * 1.01
    assert sharded.host_per_rank < 2e9  # one tensor's rows in flight and the adapter
    on_cpu = load_peak(facts, "fsdp", 4, 4, device="cpu")
    assert on_cpu.host_per_rank > weights / 4
    assert "sharded loading" in sharded.why
    h100 = 80 * 10**9
    assert "141.9 GB on each device" in load_problem(load_peak(facts, "ddp", 4, 4), h100, None)
    assert load_problem(sharded, h100, None) is None
    assert "host memory on the node" in load_problem(sharded, h100, 1 * 10**9)
    qlora = facts_from_config(LLAMA_70B, AdaptationConfig(method="qlora"),
                              architecture="causal_lm", dtype="bfloat16")  # fmt: skip
    assert load_peak(qlora, "fsdp", 4, 4).mode == "whole"  # 4-bit weights load whole


@pytest.fixture
def seventy_b_study(tmp_path, capsys) -> Path:
    from tunelab.stages.hypothesis.template import render_study_yaml

    root = tmp_path / "seventy-b"
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps(LLAMA_70B))
    rows = [
        {
            "id": f"m{i}",
            "text": f"From: user{i}@example.com\nSubject: note {i}\n\n" + "text " * (i % 40),
            "target": json.dumps({"sender": f"user{i}@example.com", "subject": f"note {i}"}),
        }
        for i in range(64)
    ]
    (root / "mail.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = yaml.safe_load(render_study_yaml("extraction", "seventy-b-plan"))
    raw["hypothesis"] = {**FILLED_HYPOTHESIS, "primary_metric": "field_micro_f1"}
    raw["data"]["source"] = {"format": "jsonl", "path": "mail.jsonl"}
    raw["data"]["fields"] = {"id": "id", "text": "text", "label": None, "target": "target"}
    raw["data"]["dedup"]["near"] = False
    raw["model"].update(path="model", dtype="bfloat16")
    raw["adaptation"].update(method="lora", target_modules="all-linear", rank=16)
    raw["preprocess"]["max_seq_len"] = 512
    raw["training"].update(micro_batch_size=1, grad_accum_steps=8, max_steps=20,
                           activation_checkpointing=True, precision="bf16")  # fmt: skip
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    for command in ("register", "data"):
        code, _, err = run_cli(capsys, command, "-s", root)
        assert code == 0, err
    return root


def test_a_layout_whose_load_cannot_fit_does_not_fit_and_sharded_fits(seventy_b_study, capsys):
    args = ("plan", "-s", seventy_b_study, "--gpu", "H100-SXM", "--gpus", "4", "--json")
    code, out, err = run_cli(capsys, *args, "--strategy", "ddp")
    assert code == 0, err
    fit = json.loads(out[out.index("{") :])["projection"]["fit"]
    assert fit["fits"] is False and fit["load"]["mode"] == "whole"
    assert fit["reason"].startswith("loading does not fit: 141.9 GB on each device")
    code, out, err = run_cli(capsys, *args, "--strategy", "fsdp")
    assert code == 0, err
    fit = json.loads(out[out.index("{") :])["projection"]["fit"]
    assert fit["fits"] is True, fit["reason"]
    assert fit["load"]["mode"] == "sharded" and fit["load"]["device_per_rank"] < 36e9
