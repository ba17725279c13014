"""The steps that really peak (`tunelab.stages.sizing.peaks`): the worst batch of the run's
seeded order, the evaluation's batch, every image family and mixture-of-experts models walked,
and an error in every sizing attempt reported as tunelab's, not as the user's memory."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import FILLED_HYPOTHESIS
from tunelab.core.config import TrainingConfig
from tunelab.core.errors import TunelabError
from tunelab.stages.sizing.memory import estimate_memory
from tunelab.stages.sizing.peaks import (
    SizingInternalError,
    evaluation_increase,
    find_worst_batch,
    refuse_unmeasured,
    worst_case,
)
from tunelab.stages.sizing.terms import Case, ModelFacts

pytestmark = pytest.mark.usefixtures("one_thread")

# predicted / measured of what a step (or the evaluation) adds to the idle process's RSS, on
# models of a few MB: the bound of the sizing's own CPU test of a measured step
LOW, HIGH = 0.6, 1.25


@pytest.mark.parametrize("packing", [True, False])
def test_the_worst_batch_is_the_one_the_trainer_meets(packing):
    """Over 12 steps of micro-batch 3 x accumulation 2 (crossing epochs of 20 examples), the
    micro-batch the trainer's own StepSource collates widest is the one found, at its step."""
    from tunelab.stages.train.batches import DataOrder, Position, StepSource

    rng = random.Random(3)
    lengths = [rng.randint(4, 90) for _ in range(20)]
    encoded = [{"input_ids": [5] * n, "labels": [5] * n} for n in lengths]
    t = TrainingConfig(micro_batch_size=3, grad_accum_steps=2, seed=7, packing=packing)
    source = StepSource(encoded, DataOrder(20, 7), 3, 2, 0, "causal_lm", packing)
    position, sizes = Position(), []
    for step in range(1, 13):
        batches, position = source.next(position)
        sizes += [(int(b["input_ids"].numel()), step) for b in batches]
    widest = max(n for n, _ in sizes)
    found = find_worst_batch(lengths, t, "causal_lm", 12)
    assert (found["tokens"] if packing else found["padded_tokens"]) == widest
    assert found["step"] == next(step for n, step in sizes if n == widest)
    assert found["packed"] is packing and found["steps_scanned"] == 12
    case = worst_case(Case(seq_len=1, micro_batch=1), found)
    assert case.tokens == widest and case.packing is packing


def test_an_error_in_every_attempt_is_internal_and_memory_is_the_users():
    rows = [
        {"label": "config @64", "status": "error", "reason": "TypeError: int() ... 'list'",
         "traceback": "Traceback (most recent call last): ..."},
        {"label": "micro 4", "status": "does_not_fit", "reason": "peak RSS above the budget"},
    ]  # fmt: skip
    with pytest.raises(SizingInternalError) as raised:
        refuse_unmeasured(rows, None)
    assert not isinstance(raised.value, TunelabError)  # the CLI writes a crash file
    assert "Traceback" in str(raised.value) and "--micro-batch" not in str(raised.value)
    with pytest.raises(TunelabError) as raised:
        refuse_unmeasured(rows[1:], None)
    assert "--micro-batch" in raised.value.hint


def _image_model(kind: str):
    import transformers

    small = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_labels=3)  # fmt: skip
    configs = {
        "swin": lambda: transformers.SwinConfig(
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 4],
            window_size=4,
            drop_path_rate=0.0,
            num_labels=3,
        ),  # fmt: skip
        "convnext": lambda: transformers.ConvNextConfig(
            hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32, num_labels=3
        ),
        "vit": lambda: transformers.ViTConfig(**small, intermediate_size=64),
        "deit": lambda: transformers.DeiTConfig(**small, intermediate_size=64),
        "dinov2": lambda: transformers.Dinov2Config(**small, mlp_ratio=2),
    }
    cfg = configs[kind]()
    torch.manual_seed(0)
    if kind == "deit":  # its auto class has a teacher variant beside it
        return transformers.DeiTForImageClassification(cfg)
    return transformers.AutoModelForImageClassification.from_config(cfg)


@pytest.mark.parametrize("kind", ["swin", "convnext", "vit", "deit", "dinov2"])
def test_every_image_family_is_walked(kind):
    """Swin's per-stage lists (depths, num_heads) included: the walk runs for each family
    that trains, and its activations are within 25 % of what autograd keeps."""
    from tunelab.lib.models.vision import patch_tokens
    from tunelab.stages.sizing.facts import count_saved_bytes, model_facts

    model = _image_model(kind).train()
    facts = model_facts(model, "image")
    if facts.conv:
        facts = replace(facts, conv={**facts.conv, "image_size": 32})
    pixels = torch.randn(8, 3, 32, 32)

    def forward():
        logits = model(pixel_values=pixels).logits
        return torch.nn.functional.cross_entropy(logits, torch.zeros(8, dtype=torch.long))

    real = count_saved_bytes(model, forward)
    length = patch_tokens(model.config.to_dict()) or 32
    est = estimate_memory(facts, Case(seq_len=length, micro_batch=8))
    assert 0.75 < est.activations / real < 1.25, (kind, est.activations, real)
    if kind == "swin":
        assert [s["hidden"] for s in facts.stages] == [16, 32] and facts.layers == 4
        assert all(t.get("q") == "weight" for t in facts.layer_training)


def _config(model_dir: Path, method: str = "full") -> dict:
    return {
        "name": "peaks-test",
        "hypothesis": dict(FILLED_HYPOTHESIS),
        "guardrails": [],
        "data": {"source": {"format": "jsonl", "path": "x.jsonl"}},
        "model": {"path": str(model_dir), "architecture": "causal_lm"},
        "adaptation": {"method": method},
        "training": {"micro_batch_size": 4, "num_threads": 1, "packing": True},
    }


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    from tunelab.lib.models.tiny import save_tiny_moe

    return save_tiny_moe(tmp_path_factory.mktemp("moe"), hidden=64, expert_intermediate=64)


@pytest.mark.slow
def test_peaks_and_a_moe_step_are_measured_within_the_sizing_bound(tiny_llama_dir, tiny_moe_dir):
    """In one measuring process: the worst packed batch (four unequal lengths), the
    evaluation's generation (512 rows of 64 prompt tokens + 4 new) and a tiny Qwen3-MoE's
    step; each predicted / measured increase within the sizing's bound."""
    from tunelab.stages.sizing.processes import measure_configurations

    lengths = [120, 97, 64, 33]
    evaluation = {"kind": "generation", "batch_size": 512, "tokens": 64, "max_new_tokens": 4}
    common = {"num_threads": 1, "packing": True, "time_steps": 2}
    specs = [
        {"config": _config(tiny_moe_dir), "label": "moe", "seq_len": 128, "micro_batch": 4,
         "grad_accum": 1, **common},
        {"config": _config(tiny_llama_dir), "label": "worst batch", "seq_len": 120,
         "micro_batch": 4, "grad_accum": 1, "peak": "worst_batch", "lengths": lengths, **common},
        {"config": _config(tiny_llama_dir), "label": "evaluation", "seq_len": 64,
         "micro_batch": 512, "peak": "evaluation", "evaluation": evaluation, **common},
    ]  # fmt: skip
    moe, worst, ev = measure_configurations(specs)
    assert [r["status"] for r in (moe, worst, ev)] == ["ok"] * 3, (moe, worst, ev)
    moe_facts = ModelFacts.from_dict(moe["facts"])
    assert moe_facts.moe and moe_facts.moe["experts"] == 8
    est = estimate_memory(moe_facts, Case(seq_len=128, micro_batch=4, packing=True))
    assert LOW < est.peak_increase / moe["measured"]["increase"] < HIGH
    facts = ModelFacts.from_dict(worst["facts"])
    batch = {"lengths": lengths, "packed": True}
    est = estimate_memory(facts, worst_case(Case(seq_len=1, micro_batch=1), batch))
    assert LOW < est.peak_increase / worst["measured"]["increase"] < HIGH
    assert worst["measured"]["tokens_per_step"] == sum(lengths)
    predicted = evaluation_increase(facts, evaluation)
    assert predicted["kv_cache"] > 0
    assert LOW < predicted["increase"] / ev["measured"]["increase"] < HIGH, (
        predicted,
        ev["measured"],
    )


def test_a_plan_provisions_the_larger_of_training_and_evaluation(tiny_llama_dir):
    """`plan_peak` (what `tunelab plan` calls per card): the training peak while the
    evaluation's is smaller; the evaluation's, and the reason naming its batch, when a batch
    of 4,096 rows x 1,000 + 512 tokens outgrows the card."""
    from transformers import AutoModelForCausalLM

    from tunelab.core.config import validate_config
    from tunelab.stages.sizing.facts import model_facts
    from tunelab.stages.sizing.peaks import plan_peak

    facts = model_facts(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), "causal_lm")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}}
    raw = {**_config(tiny_llama_dir), "task": {"kind": "extraction", "json_schema": schema}}
    small = validate_config(raw, source="test")
    big = validate_config(
        {**raw, "evaluation": {"batch_size": 4096, "max_new_tokens": 512}}, source="test"
    )
    card = 2 * 10**9
    assert plan_peak(10**9, facts, small, 1000, "bf16", card) == (10**9, None)
    peak, over = plan_peak(10**9, facts, big, 1000, "bf16", card)
    settings = {"kind": "generation", "batch_size": 4096, "tokens": 1000, "max_new_tokens": 512}
    added = evaluation_increase(facts, settings, "bf16")["increase"]
    assert peak == facts.total_weight_bytes + added > card
    assert "evaluation.batch_size 4096" in over
