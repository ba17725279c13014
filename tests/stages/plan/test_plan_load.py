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
from tunelab.stages.sizing.load import load_peak, load_problem, load_table, strategy_refusal

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
    assert "141.9 GB on each GPU" in load_problem(load_peak(facts, "ddp", 4, 4), h100, None)
    assert load_problem(sharded, h100, None) is None
    assert "host memory on the node" in load_problem(sharded, h100, 1 * 10**9)
    qlora = facts_from_config(LLAMA_70B, AdaptationConfig(method="qlora"),
                              architecture="causal_lm", dtype="bfloat16")  # fmt: skip
    assert load_peak(qlora, "fsdp", 4, 4).mode == "whole"  # 4-bit weights load whole
    assert "refuses qlora under fsdp" in strategy_refusal(qlora, "fsdp", "bf16")
    assert strategy_refusal(qlora, "ddp", "bf16") is None


def test_size_records_the_load_of_each_rank_count():
    facts = facts_from_config(LLAMA_70B, LORA_ALL, architecture="causal_lm", dtype="bfloat16")
    rows = {(r["ranks"], r["strategy"]): r for r in load_table(facts, (2, 4), 80 * 10**9, "cuda")}
    assert set(rows) == {(1, "single"), (2, "ddp"), (2, "fsdp"), (4, "ddp"), (4, "fsdp")}
    for key in ((1, "single"), (2, "ddp"), (4, "ddp")):  # 141.9 GB on every GPU
        assert rows[key]["problem"].startswith("the load does not fit"), key
    for n in (2, 4):  # 71.0 and 35.5 GB a GPU
        assert rows[(n, "fsdp")]["problem"] is None and rows[(n, "fsdp")]["mode"] == "sharded"
    # on a CPU the budget is the node's memory: four whole copies, or four quarters
    on_cpu = {(r["ranks"], r["strategy"]): r for r in load_table(facts, (4,), 300 * 10**9, "cpu")}
    assert "host memory on the node" in on_cpu[(4, "ddp")]["problem"]
    assert on_cpu[(4, "fsdp")]["problem"] is None


# a Llama of about 1 B parameters: its whole model and its evaluation fit one 80 GB GPU
LLAMA_1B = {**LLAMA_70B, "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 32, "num_hidden_layers": 16}  # fmt: skip


def _config_only_study(root: Path, config: dict, capsys) -> Path:
    """A registered extraction study with data whose base is `config` alone (no weights)."""
    from tunelab.stages.hypothesis.template import render_study_yaml

    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps(config))
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


@pytest.fixture
def seventy_b_study(tmp_path, capsys) -> Path:
    return _config_only_study(tmp_path / "seventy-b", LLAMA_70B, capsys)


@pytest.fixture
def one_b_study(tmp_path, capsys) -> Path:
    return _config_only_study(tmp_path / "one-b", LLAMA_1B, capsys)


def test_a_layout_whose_load_cannot_fit_does_not_fit_and_sharded_loads(seventy_b_study, capsys):
    args = ("plan", "-s", seventy_b_study, "--gpu", "H100-SXM", "--gpus", "4", "--json")
    code, out, err = run_cli(capsys, *args, "--strategy", "ddp")
    assert code == 0, err
    fit = json.loads(out[out.index("{") :])["projection"]["fit"]
    assert fit["fits"] is False and fit["load"]["mode"] == "whole"
    assert fit["reason"].startswith("the load does not fit: 141.9 GB on each GPU")
    assert "weights 141.9 GB, loaded whole on every rank" in fit["reason"]
    code, out, err = run_cli(capsys, *args, "--strategy", "fsdp")
    assert code == 0, err
    fit = json.loads(out[out.index("{") :])["projection"]["fit"]
    assert fit["load"]["mode"] == "sharded" and fit["load"]["device_per_rank"] < 36e9
    # training fits sharded, but `tunelab eval` loads the whole model on one GPU
    assert fit["fits"] is False
    assert fit["reason"].startswith(
        "the evaluation does not fit: 143.8 GB on one GPU, over its 80.0"
    )
    assert "evaluation.batch_size 16 x" in fit["reason"]
    assert "use a GPU with more memory (the weights alone are 141.9 GB)" in fit["reason"]
    # on GPUs that hold the evaluation, the sharded layout fits
    code, out, err = run_cli(capsys, *args[:4], "MI300X", *args[5:], "--strategy", "fsdp")
    assert code == 0, err
    fit = json.loads(out[out.index("{") :])["projection"]["fit"]
    assert fit["fits"] is True, fit["reason"]


def test_compare_gpus_tries_multi_gpu_layouts_and_recommends_only_what_loads(
    seventy_b_study, capsys
):
    code, out, err = run_cli(capsys, "plan", "-s", seventy_b_study, "--compare-gpus", "--json")
    assert code == 0, err
    result = json.loads(out[out.index("{") :])
    assert result["gpus"] == [1, 2, 4, 8] and result["currency"] == "USD"
    layouts = {(r["gpu"], r["gpus"], r["strategy"]): r for r in result["layouts"]}
    h100 = {k[1:]: r for k, r in layouts.items() if k[0] == "H100-SXM"}
    assert set(h100) == {(1, "single"), *((n, s) for n in (2, 4, 8) for s in ("ddp", "fsdp"))}
    for n in (1, 2, 4, 8):  # the whole base on every GPU: 141.9 GB over 80 GB, at any count
        whole = h100[(n, "single" if n == 1 else "ddp")]
        assert not whole["fits"] and whole["why_not"].startswith("the load does not fit")
        assert whole["load"]["mode"] == "whole"
    # sharded, the load and the training step fit; the evaluation on one GPU does not
    sharded = h100[(4, "fsdp")]
    assert sharded["load"]["mode"] == "sharded" and sharded["load"]["device_per_rank"] < 36e9
    assert not sharded["fits"] and sharded["why_not"].startswith("the evaluation does not fit")
    assert not any(r["fits"] for r in result["rows"] if r["gpu"] == "H100-SXM")
    best = next(r for r in result["rows"] if r["gpu"] == "MI300X")  # 192 GB hold it
    assert best["fits"] and best["strategy"] in ("single", "ddp", "fsdp")
    # every layout that fits loads and evaluates: its load and the evaluation fit the GPU
    for r in result["layouts"]:
        if r["fits"]:
            assert r["load"]["device_per_rank"] < r["memory_bytes"]
            assert r["memory_bytes"] > 143.8e9
            assert r["strategy"] in ("single", "ddp", "fsdp")
    answer = result["answer"]
    picked = layouts[(answer["gpu"], answer["gpus"], answer["strategy"])]
    assert picked["fits"]
    code, out, err = run_cli(capsys, "plan", "-s", seventy_b_study, "--compare-gpus")
    assert code == 0, err
    assert "RTX-4090: does not fit at 1/2/4/8 GPUs (ddp: load 141.9 GB a GPU over 24 GB" in out
    assert "evaluation 143.8 GB on one GPU, over its 80.0 GB" in " ".join(out.split())
    assert f"answer: {answer['gpus']}x {answer['gpu']}" in out and " USD for the rental" in out
    assert "busy USD" in out


def test_validate_refuses_a_layout_whose_load_cannot_fit(seventy_b_study, capsys):
    args = ("validate", "-s", seventy_b_study, "--nproc", "4")
    code, _, err = run_cli(capsys, *args, "--strategy", "ddp", "--gpu", "H100-SXM")
    assert code == 2
    assert "--nproc 4 --strategy ddp on --gpu H100-SXM: the load does not fit: 141.9 GB" in err
    assert "weights 141.9 GB, loaded whole on every rank" in err
    code, _, err = run_cli(capsys, *args, "--strategy", "fsdp", "--memory-budget", "30GB")
    assert code == 2 and "on GPUs of 30.0 GB (--memory-budget)" in err
    assert "GB on each GPU, over its 30.0 GB (sharded loading: each rank reads its 1/4" in err
    # the sharded layout loads on 80 GB GPUs, but its evaluation needs one GPU of about 146 GB
    # at the longest sequence max_seq_len allows
    code, out, err = run_cli(capsys, *args, "--strategy", "fsdp", "--memory-budget", "80GB")
    assert code == 2
    assert "on GPUs of 80.0 GB (--memory-budget): the evaluation does not fit: 146.0 GB" in err
    assert "evaluation.batch_size 16 x 448 tokens + 64 new" in err
    assert "use a GPU with more memory" in err
    code, out, err = run_cli(capsys, *args, "--strategy", "fsdp", "--memory-budget", "160GB")
    assert code == 0, err
    assert "valid" in out


def test_size_refuses_a_layout_whose_evaluation_cannot_fit_one_device():
    facts = facts_from_config(LLAMA_70B, LORA_ALL, architecture="causal_lm", dtype="bfloat16")
    settings = {"kind": "generation", "batch_size": 16, "tokens": 448, "max_new_tokens": 64}
    evaluation = {"settings": settings, "status": "ok", "measured": {"peak_total": 146 * 10**9}}
    rows = load_table(facts, (4,), 80 * 10**9, "cuda", evaluation)
    fsdp = next(r for r in rows if r["strategy"] == "fsdp")
    assert fsdp["mode"] == "sharded"  # it loads, but evaluates on one GPU
    assert fsdp["problem"].startswith("the evaluation does not fit: 146.0 GB on one GPU")
    assert "use a GPU with more memory (the weights alone are 141.9 GB)" in fsdp["problem"]
    held = load_table(facts, (4,), 192 * 10**9, "cuda", evaluation)
    assert all(r["problem"] is None for r in held if r["strategy"] != "ddp")
    # a smaller evaluation batch is the way out where the weights alone fit
    small = facts_from_config(LLAMA_1B, LORA_ALL, architecture="causal_lm", dtype="bfloat16")
    over = {**evaluation, "measured": {"peak_total": 90 * 10**9}}
    problem = load_table(small, (4,), 80 * 10**9, "cuda", over)[0]["problem"]
    assert "a smaller evaluation.batch_size or evaluation.max_new_tokens" in problem


def test_a_small_study_fits_its_training_and_evaluation_on_four_gpus(one_b_study, capsys):
    args = ("plan", "-s", one_b_study, "--gpu", "H100-SXM", "--gpus", "4", "--json")
    for strategy in ("ddp", "fsdp"):
        code, out, err = run_cli(capsys, *args, "--strategy", strategy)
        assert code == 0, err
        fit = json.loads(out[out.index("{") :])["projection"]["fit"]
        assert fit["fits"] is True, fit["reason"]
    code, out, err = run_cli(capsys, "validate", "-s", one_b_study, "--nproc", "4",
                             "--strategy", "fsdp", "--gpu", "H100-SXM")  # fmt: skip
    assert code == 0, err
