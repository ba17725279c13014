"""Planning before renting: the GPU catalog, the FLOP model against hand counts, the analytic
facts against a loaded model, the micro-batch choice against the sizing's memory model, and
`tunelab plan --gpu` / `--compare-gpus` on a study that names only a config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import FILLED_HYPOTHESIS, run_cli, write_config_only_study
from tunelab.core.config_training import AdaptationConfig
from tunelab.stages.plan.catalog import find_gpu, gpu_of_device, gpus
from tunelab.stages.plan.flops import MicroBatch, micro_step_flops
from tunelab.stages.plan.shapes import facts_from_config

# Llama-3.2-1B's published config.json (the values that shape the model)
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
FULL = AdaptationConfig(method="full")
LORA_QV = AdaptationConfig(method="lora", target_modules=["q_proj", "v_proj"], rank=8)


def test_llama_1b_parameters_by_hand():
    facts = facts_from_config(LLAMA_1B, FULL, architecture="causal_lm")
    # per block: q 2048x2048, k and v 2048x512, o 2048x2048, gate/up/down 2048x8192, 2 norms
    block = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192 + 2 * 2048
    assert block == 60_821_504
    assert facts.num_params == 16 * block + 128256 * 2048 + 2048 == 1_235_814_400
    assert facts.trainable_params == facts.num_params and facts.head == "weight"
    lora = facts_from_config(LLAMA_1B, LORA_QV, architecture="causal_lm")
    # LoRA r=8 on q (2048 -> 2048) and v (2048 -> 512): r x (in + out) each, 16 blocks
    assert lora.trainable_params == 16 * 8 * ((2048 + 2048) + (2048 + 512)) == 851_968
    assert lora.num_params == facts.num_params + lora.trainable_params


@pytest.mark.parametrize("config", ["tiny", "llama-1b"])
def test_full_fine_tuning_costs_6n_flops_per_token(config, tiny_llama_dir):
    """With the loss at every position and no attention pairs: 6 FLOPs per matmul weight per
    token (the tied embedding counts once, as the head)."""
    cfg = (
        LLAMA_1B
        if config == "llama-1b"
        else json.loads((tiny_llama_dir / "config.json").read_text())
    )
    facts = facts_from_config(cfg, FULL, architecture="causal_lm")
    norms = facts.layers * 2 * facts.hidden + facts.hidden
    matmul_weights = facts.num_params - norms
    tokens = 1000
    flops = micro_step_flops(facts, MicroBatch(tokens, 0, tokens, 1), checkpointing=False)
    assert flops.total == pytest.approx(6 * matmul_weights * tokens)
    assert flops.forward == pytest.approx(2 * matmul_weights * tokens)
    if config == "llama-1b":
        assert matmul_weights == 1_235_746_816


@pytest.mark.parametrize("config", ["tiny", "llama-1b"])
def test_lora_costs_4n_plus_6_per_adapter_weight(config, tiny_llama_dir):
    """A frozen base: forward (2N) and the input gradients (2N), no weight gradients; each adapter
    weight costs 6 like a trained one."""
    cfg = (
        LLAMA_1B
        if config == "llama-1b"
        else json.loads((tiny_llama_dir / "config.json").read_text())
    )
    full = facts_from_config(cfg, FULL, architecture="causal_lm")
    lora = facts_from_config(cfg, LORA_QV, architecture="causal_lm")
    matmul_weights = full.num_params - (full.layers * 2 * full.hidden + full.hidden)
    tokens = 1000
    flops = micro_step_flops(lora, MicroBatch(tokens, 0, tokens, 1), checkpointing=False)
    expected = (4 * matmul_weights + 6 * lora.trainable_params) * tokens
    assert flops.total == pytest.approx(expected)


def test_attention_head_positions_and_checkpointing():
    facts = facts_from_config(LLAMA_1B, FULL, architecture="causal_lm")
    base = micro_step_flops(facts, MicroBatch(2048, 0, 2048, 1), checkpointing=False)
    # one causal sequence of 2048 tokens: 2048 x 2049 / 2 (query, key) pairs, 4 x heads x
    # head_dim FLOPs each forward, twice that backward, in every block
    pairs = 2048 * 2049 / 2
    attn = micro_step_flops(facts, MicroBatch(2048, pairs, 2048, 1), checkpointing=False)
    assert attn.total - base.total == pytest.approx(3 * 16 * 4 * 32 * 64 * pairs)
    # the head at the loss positions only: a quarter of them saves 3/4 of its 6 x V x h
    quarter = micro_step_flops(facts, MicroBatch(2048, 0, 512, 1), checkpointing=False)
    assert base.total - quarter.total == pytest.approx(6 * 128256 * 2048 * (2048 - 512))
    # checkpointing runs every block's forward once more (not the head's)
    ckpt = micro_step_flops(facts, MicroBatch(2048, 0, 2048, 1), checkpointing=True)
    head_forward = 2 * 2048 * 128256 * 2048
    assert ckpt.recompute == pytest.approx(base.forward - head_forward)


def test_facts_from_config_equal_the_loaded_models(tiny_llama_dir, tiny_bert_dir):
    """The analytic facts of a config.json and an adaptation are those `model_facts` reads from
    the model itself, adapted."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tunelab.lib.models.adapt import adapt
    from tunelab.stages.sizing.facts import model_facts

    llama = json.loads((tiny_llama_dir / "config.json").read_text())
    all_linear = AdaptationConfig(method="lora", target_modules="all-linear", rank=4)
    for adaptation in (LORA_QV, FULL, all_linear):
        model, _ = adapt(
            AutoModelForCausalLM.from_pretrained(tiny_llama_dir), adaptation, "causal_lm"
        )
        lora = adaptation.method == "lora"
        real = model_facts(model, "causal_lm", lora_rank=adaptation.rank if lora else 0)
        assert facts_from_config(llama, adaptation, architecture="causal_lm") == real
    bert = json.loads((tiny_bert_dir / "config.json").read_text())
    for adaptation in (AdaptationConfig(method="lora", target_modules=["query", "value"]), FULL):
        model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=3)
        model, _ = adapt(model, adaptation, "encoder")
        lora = adaptation.method == "lora"
        real = model_facts(model, "encoder", lora_rank=adaptation.rank if lora else 0)
        mine = facts_from_config(bert, adaptation, architecture="encoder", num_labels=3)
        assert mine == real


def test_catalog_entries_and_names():
    ids = [g.id for g in gpus()]
    for wanted in ("H200", "H100-SXM", "H100-PCIe", "A100-80GB", "A100-40GB", "L40S", "L4"):
        assert wanted in ids
    assert {"RTX-4090", "MI300X"} <= set(ids)
    for g in gpus():
        assert g.source and g.price_per_hour > 0 and g.memory_gb >= 24
        assert g.tflops_bf16 >= g.tflops_fp32 > 0 and g.bandwidth_gbs > 0
    assert find_gpu("h100-sxm").id == find_gpu("H100SXM").id == "H100-SXM"
    assert find_gpu("mi300").id == "MI300X"
    from tunelab.core.errors import ConfigError

    with pytest.raises(ConfigError, match="several"):
        find_gpu("H100")
    with pytest.raises(ConfigError) as err:
        find_gpu("V100")
    assert "H200" in err.value.hint
    names = {
        "NVIDIA H100 80GB HBM3": "H100-SXM",
        "NVIDIA H100 PCIe": "H100-PCIe",
        "NVIDIA A100-SXM4-40GB": "A100-40GB",
        "NVIDIA A100-SXM4-80GB": "A100-80GB",
        "NVIDIA L4": "L4",
        "NVIDIA L40S": "L40S",
        "NVIDIA GeForce RTX 4090": "RTX-4090",
        "AMD Instinct MI300X": "MI300X",
        "NVIDIA H200": "H200",
    }
    for name, gpu_id in names.items():
        assert gpu_of_device(name).id == gpu_id
    assert gpu_of_device("Tesla T4") is None


def _config(**training):
    from tunelab.core.config import validate_config
    from tunelab.stages.hypothesis.template import render_study_yaml

    raw = yaml.safe_load(render_study_yaml("extraction", "plan-gpu"))
    raw["hypothesis"] = {**FILLED_HYPOTHESIS, "primary_metric": "field_micro_f1"}
    raw["training"].update(training)
    return validate_config(raw)


def _shape(facts, length: int = 2048):
    from tunelab.stages.plan.figures import SplitCounts
    from tunelab.stages.plan.project import StudyShape

    return StudyShape(
        facts, "test", (length,), length, length, "test", 1.0, "test", True,
        SplitCounts(1000, 100, 100), True, 1, 8, 200, 50, "test", "bf16", "test",
    )  # fmt: skip


def test_the_largest_micro_batch_that_fits_by_the_sizing_model():
    """The chosen micro-batch's peak (the sizing's memory model, bf16 on CUDA) fits the GPU less
    the margin and the CUDA context; the next larger one that keeps the effective batch does
    not; a GPU too small for any falls back to checkpointing, then says it does not fit."""
    from tunelab.stages.plan.project import CUDA_CONTEXT_BYTES, choose_fit
    from tunelab.stages.sizing.memory import estimate_memory
    from tunelab.stages.sizing.recommend import SAFETY_MARGIN
    from tunelab.stages.sizing.terms import Case

    cfg = _config(micro_batch_size=4, grad_accum_steps=8, max_steps=10)
    facts = facts_from_config(LLAMA_1B, FULL, architecture="causal_lm")
    shape = _shape(facts)
    h100 = find_gpu("H100-SXM")
    fit = choose_fit(shape, cfg, h100, 1, "ddp")
    assert fit.fits and fit.micro_batch * fit.grad_accum == 32 and not fit.checkpointing
    limit = h100.memory_bytes * (1 - SAFETY_MARGIN)

    def peak(micro: int, ckpt: bool = False) -> int:
        case = Case(2048, micro, 32 // micro, "bf16", ckpt, True, False, 1.0, device="cuda")
        return CUDA_CONTEXT_BYTES + estimate_memory(facts, case).peak_total

    assert fit.peak_bytes == peak(fit.micro_batch) <= limit
    bigger = min(d for d in (1, 2, 4, 8, 16, 32) if d > fit.micro_batch)
    assert peak(bigger) > limit
    l4 = find_gpu("L4")
    small = choose_fit(shape, cfg, l4, 1, "ddp")
    assert small.checkpointing or not small.fits
    # FSDP over 8 GPUs shards the weights, gradients and states: more fits per GPU
    sharded = choose_fit(shape, cfg, l4, 8, "fsdp")
    assert sharded.micro_batch * sharded.grad_accum == 4
    assert sharded.fits


# ------------------------------------------------------------------ a study named by its config


@pytest.fixture
def config_only_study(tmp_path, capsys) -> Path:
    """An extraction study on Llama-3.2-1B's shape: a config.json and no weights."""
    return write_config_only_study(tmp_path / "one-b", LLAMA_1B, capsys)


@pytest.fixture
def narrow(monkeypatch):
    from tunelab.cli import common

    monkeypatch.setattr(common.console, "width", 80)


def test_compare_gpus_on_a_config_only_1b_study(config_only_study, capsys, narrow):
    code, out, err = run_cli(capsys, "plan", "-s", config_only_study, "--compare-gpus", "--json")
    assert code == 0, err
    result = json.loads(out[out.index("{") :])
    rows = result["rows"]
    assert len(rows) == len(gpus())
    fitting = [r for r in rows if r["fits"]]
    assert [r["busy_cost"] for r in fitting] == sorted(r["busy_cost"] for r in fitting)
    assert rows[: len(fitting)] == fitting  # the cards where it does not fit come last
    for r in rows:
        assert r["step_low_s"] <= r["step_s"] <= r["step_high_s"]
        assert r["micro_batch"] * r["grad_accum"] * r["gpus"] == 16
        assert set(r["variants"]) == {"3", "7", "30"}
    kinds = {i["name"]: i["kind"] for i in result["inputs"]}
    assert kinds["model"] == "read" and kinds["lengths"] == "assumed"
    # no tokenizer: the snapshot's texts at 4 characters a token, not max_seq_len for all
    lengths = next(i["value"] for i in result["inputs"] if i["name"] == "lengths")
    mean = float(lengths.split()[1].rstrip(","))
    assert 10 < mean < 100 and "4 characters a token" in result["inputs"][1]["source"]
    assert "H100-SXM" in result["sources"]
    code, out, err = run_cli(capsys, "plan", "-s", config_only_study, "--compare-gpus")
    assert code == 0, err
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    for r in rows:  # a row of the table, or a line saying why it fits no layout
        assert any(line.lstrip().startswith((r["gpu"] + " ", r["gpu"] + ":")) for line in lines)
    assert "assumed: lengths" in out and "read: model" in out and "utilization" in out
    answer = result["answer"]
    assert answer["gpu"] in {r["gpu"] for r in fitting} and answer["days"] in (3, 7, 30)
    assert f"answer: {answer['gpus']}x {answer['gpu']}" in out
    assert f"for {answer['days']} days" in out


def _row(gpu, fits, variants, rental_cost, busy_hours=1.0):
    from tunelab.core.record_plan import RentalOption

    row = {
        "gpu": gpu,
        "fits": fits,
        "variants": dict(zip((3, 7, 30), variants, strict=True)),
        "rental_cost": rental_cost,
        "busy_hours": busy_hours,
    }
    return RentalOption.of("layouts", row, gpu)


def test_cheapest_rental_is_the_shortest_that_holds_the_variants_then_the_cheapest():
    from tunelab.stages.plan.stage import cheapest_rental

    rows = [
        _row("L4", True, (1, 3, 12), 700.0),  # 7-day cost 700: needs 30 days for 4, 3000
        _row("H100", True, (5, 12, 50), 2100.0),  # 4 fit in 3 days: 900
        _row("A100", True, (4, 9, 40), 1400.0),  # 3 days: 600, the answer
        _row("B200", False, (99, 99, 99), 10.0),  # does not fit its memory
    ]
    assert cheapest_rental(rows, 4, 7) == {
        "gpu": "A100",
        "days": 3,
        "rental_cost": 600.0,
        "busy_hours": 1.0,
    }
    assert cheapest_rental(rows, 45, 7)["gpu"] == "H100"
    assert "within 30 days" in cheapest_rental(rows, 60, 7)["why"]
    assert "memory" in cheapest_rental(rows[3:], 1, 7)["why"]


def test_gpu_plan_on_a_config_only_1b_study(config_only_study, capsys, narrow):
    code, out, err = run_cli(
        capsys, "plan", "-s", config_only_study, "--gpu", "H100-SXM", "--days", "7", "--json"
    )
    assert code == 0, err
    record = json.loads(out[out.index("{") :])
    proj = record["projection"]
    assert proj["gpu"] == "H100-SXM" and proj["fit"]["fits"]
    assert record["gpu"] == "1x NVIDIA H100 SXM 80GB"
    assert record["step_time_s"] == pytest.approx(proj["step"]["value"])
    assert record["figures"]["step_s"]["source"].startswith("projected on 1x H100-SXM")
    assert record["cost"]["rental_cost"] == pytest.approx(7 * 24 * proj["price_per_gpu_hour"])
    assert not any("measured on CPU" in w for w in record["warnings"])
    two = run_cli(capsys, "plan", "-s", config_only_study, "--gpu", "H100-SXM", "--gpus", "2",
                  "--strategy", "fsdp", "--gpu-hour-price", "2", "--json")  # fmt: skip
    assert two[0] == 0, two[2]
    record2 = json.loads(two[1][two[1].index("{") :])
    assert record2["cost"]["rental_cost"] == pytest.approx(7 * 24 * 2 * 2)
    assert record2["projection"]["step"]["communication_s"] > 0
    code, out, err = run_cli(capsys, "plan", "-s", config_only_study, "--gpu", "H100-SXM")
    assert code == 0, err
    assert "plan on 1x NVIDIA H100 SXM 80GB" in out and "datasheet: GPU" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_gpu_plan_refusals(config_only_study, capsys):
    for args, expect in (
        (["--gpu", "V100"], "not in the GPU catalog"),
        (["--gpu", "H100-SXM", "--speedup", "3"], "do not apply"),
        (["--gpu", "H100-SXM", "--gpus", "3"], "does not divide"),
        (["--gpu", "H100-SXM", "--strategy", "zero3"], "ddp|fsdp"),
        (["--gpu", "H100-SXM", "--utilization", "1.5"], "share of the peak"),
    ):
        code, _, err = run_cli(capsys, "plan", "-s", config_only_study, *args)
        assert code == 2 and expect in err, (args, err)


def test_a_damaged_projection_is_named_with_its_file_and_field(config_only_study, capsys):
    """A GPU plan whose projection was edited by hand: the review refuses it at read time,
    naming the record, the place in it and the field (exit 2), not a traceback."""
    code, _, err = run_cli(capsys, "plan", "-s", config_only_study, "--gpu", "H100-SXM")
    assert code == 0, err
    (path,) = (config_only_study / "records" / "plans").glob("plan-*.json")
    record = json.loads(path.read_text())
    record["projection"]["fit"]["micro_batch"] = "four"
    path.write_text(json.dumps(record))
    code, _, err = run_cli(capsys, "plan", "-s", config_only_study, "--review")
    assert code == 2
    assert path.name in err and "projection.fit: field 'micro_batch' is 'four'" in err, err


def test_a_step_measured_on_a_gpu_replaces_the_default_utilization():
    from tunelab.core.record_types import Sizing
    from tunelab.stages.plan.project import measured_utilization, resolve_utilization

    facts = facts_from_config(LLAMA_1B, FULL, architecture="causal_lm")
    shape = _shape(facts)
    sizing = {
        "id": "size-gpu",
        "device": "cuda",
        "env": {"gpus": [{"name": "NVIDIA H200"}]},
        "throughput": {"row": "config @2048", "step_s": 0.433},
        "configurations": [
            {
                "label": "config @2048",
                "status": "ok",
                "options": {
                    "seq_len": 2048,
                    "micro_batch": 8,
                    "grad_accum": 1,
                    "checkpointing": False,
                    "precision": "bf16",
                },  # fmt: skip
            }
        ],
    }
    measured = measured_utilization(Sizing.of("size-gpu.json", sizing), shape)
    assert measured is not None and measured[1].id == "H200"
    assert measured[0] == pytest.approx(0.30, abs=0.01)  # the H200 row of the catalog's default
    util, was_measured, _ = resolve_utilization(find_gpu("H100-SXM"), "full", None, measured)
    assert was_measured and util.value == measured[0] and "measured: sizing size-gpu" in util.source
    other, was, notes = resolve_utilization(find_gpu("A100-80GB"), "full", None, measured)
    assert not was and notes and "another architecture" in notes[0]
    given, _, _ = resolve_utilization(find_gpu("H100-SXM"), "full", 0.5, measured)
    assert given.value == given.low == given.high == 0.5
    on_cpu = Sizing.of("size-cpu.json", {**sizing, "device": "cpu"})
    assert measured_utilization(on_cpu, shape) is None


def test_review_of_a_gpu_plan_against_the_runs_that_followed(pinned, capsys):  # noqa: F811
    """A GPU plan is reviewed like any other, phase by phase; runs made on another device are
    named, since their durations test that device and not the plan."""
    code, _, err = run_cli(capsys, "plan", "-s", pinned, "--gpu", "L4", "--days", "3")
    assert code == 0, err
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--review", "--json")
    assert code == 0, err
    review = json.loads(out[out.index("{") :])
    rows = {r["phase"]: r for r in review["rows"]}
    assert rows["experiments"]["actual_s"] > 0 and rows["experiments"]["planned_s"] > 0
    assert review["notes"] and "ran on cpu, not on NVIDIA L4 24GB" in review["notes"][0]
    code, out, _ = run_cli(capsys, "plan", "-s", pinned, "--review")
    assert code == 0 and "note:" in out and "not on NVIDIA L4" in out


def test_a_training_run_on_a_gpu_sets_the_utilization(pinned, capsys):  # noqa: F811
    """A training run of the study on a catalog GPU (its env.json) measures the share of the
    peak its steps reached; a plan for a GPU of that architecture uses it, others keep the
    catalog's default and say why."""
    from tunelab.core.records import read_json, write_json_atomic

    runs = sorted((pinned / "records" / "runs").glob("train-*"))
    env = read_json(runs[-1] / "env.json")
    env.update(compute_device="cuda:0", gpus=[{"name": "NVIDIA H100 80GB HBM3"}])
    write_json_atomic(runs[-1] / "env.json", env, overwrite=True)
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--gpu", "H200", "--json")
    assert code == 0, err
    proj = json.loads(out[out.index("{") :])["projection"]
    assert proj["utilization_measured"]
    assert proj["utilization"]["source"].startswith(f"measured: train run {runs[-1].name}")
    assert proj["utilization"]["low"] < proj["utilization"]["value"] < proj["utilization"]["high"]
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--gpu", "A100-80GB", "--json")
    record = json.loads(out[out.index("{") :])
    assert not record["projection"]["utilization_measured"]
    assert any("another architecture" in w for w in record["warnings"])
