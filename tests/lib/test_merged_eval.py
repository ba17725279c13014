"""Evaluation through a merged LoRA copy (checked on the first batch) and generation that stops
at the end of the answer: the same outputs as the unmerged model and plain greedy decoding."""

from __future__ import annotations

import pytest

from helpers.evaluate import (
    LABELS,
    causal_classifier,
    cls_examples,
    extraction_examples,
    load,
    make_study,
)

TRAILING = " and then some more words after the answer"


def lora(study, model, base):
    """The study's LoRA adapter on `model`, with B moved off zero (an adapter that changes the
    outputs, as a trained one does)."""
    import torch

    from tunelab.lib.models import adapt

    model, _ = adapt(model, study.config.adaptation, base.architecture)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_merged_copy_leaves_the_model_unmerged_and_shares_the_rest(tmp_path, tiny_llama_dir):
    import torch

    from tunelab.lib.inference.eval_copy import lora_layers, merged_copy, unmergeable_reason

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, _, base = load(study)
    assert unmergeable_reason(model) == "the model has no adapter to merge"
    model = lora(study, model, base)
    assert unmergeable_reason(model) is None
    before = params_of(model)
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        merged = merged_copy(model)
        got = merged(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert not lora_layers(merged) and lora_layers(model)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(again, want)  # the model as loaded is untouched, adapter still applied
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    shared = {p.data_ptr() for p in model.parameters()}
    embed = merged.get_input_embeddings().weight
    assert embed.data_ptr() in shared  # not copied: the merge never writes it
    q = merged.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() not in shared  # the merge writes here: a copy


def test_extraction_evaluated_merged_gives_the_unmerged_outputs(tmp_path, tiny_llama_dir):
    from tunelab.lib.inference.eval_copy import describe_copy
    from tunelab.stages.evaluate.stage import evaluate_model

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, base = load(study)
    model = lora(study, model, base)
    record, preds = evaluate_model(model, tok, base, study, extraction_examples(), "validation")
    forced, unmerged = evaluate_model(
        model, tok, base, study, extraction_examples(), "validation", merge=False
    )
    assert record["merge"]["merged"] is True, record["merge"]
    assert record["merge"]["reason"].startswith(
        "first batch: 3 outputs greedy for the model as loaded (teacher-forced)"
    )
    assert forced["merge"] == {
        "merged": False,
        "copy": False,
        "reason": "the recorded evaluation ran on the model as loaded",
    }
    assert [p["raw_output"] for p in preds] == [p["raw_output"] for p in unmerged]
    # on a CPU the copy's linear layers (2 blocks x 7 and the lm_head) are packed; the model as
    # loaded keeps its dense ones
    assert record["merge"]["packed"] == {"linears": 2 * 7 + 1, "kernel": "onednn"}
    assert describe_copy(record["merge"]) == "merged copy, 15 linear layers packed"
    assert any(type(m).__name__ == "Linear" for m in model.modules())
    # a recorded merged choice is reproduced without a check
    again, repro = evaluate_model(
        model, tok, base, study, extraction_examples(), "validation", merge=True
    )
    assert again["merge"]["merged"] is True and "check_s" not in again["merge"]
    assert [p["raw_output"] for p in repro] == [p["raw_output"] for p in preds]


def test_a_model_without_adapter_is_evaluated_on_a_packed_copy(tmp_path, tiny_llama_dir):
    """A baseline's linear layers are packed in a copy, checked like a merge on the first
    batch; the outputs are those of the model as loaded, and a recorded choice reproduces."""
    from tunelab.lib.inference.eval_copy import describe_copy
    from tunelab.stages.evaluate.stage import evaluate_model
    from tunelab.stages.verify.stage import recorded_copy

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, base = load(study)
    record, preds = evaluate_model(model, tok, base, study, extraction_examples(), "validation")
    merge = record["merge"]
    assert merge["copy"] is True and merge["merged"] is False, merge
    assert merge["packed"] == {"linears": 2 * 7 + 1, "kernel": "onednn"}
    assert merge["unmerged"] == "the model has no adapter to merge"
    assert merge["reason"].startswith("first batch: 3 outputs greedy")
    assert describe_copy(merge) == "copy with 15 linear layers packed"
    assert recorded_copy(record) is True
    assert all(type(m).__name__ != "PackedLinear" for m in model.modules())
    loaded, plain = evaluate_model(
        model, tok, base, study, extraction_examples(), "validation", merge=False
    )
    assert loaded["merge"]["copy"] is False
    assert describe_copy(loaded["merge"]).startswith("the model as loaded: ")
    assert [p["raw_output"] for p in preds] == [p["raw_output"] for p in plain]
    again, repro = evaluate_model(
        model, tok, base, study, extraction_examples(), "validation", merge=True
    )
    assert again["merge"]["copy"] is True and "check_s" not in again["merge"]
    assert [p["raw_output"] for p in repro] == [p["raw_output"] for p in preds]


def test_an_encoder_classifier_is_scored_on_a_packed_copy(tmp_path, tiny_bert_dir):
    """An encoder's linear layers have biases; its packed copy's scores stay within the verify
    tolerance of the model as loaded, with the same labels."""
    from tunelab.stages.evaluate.stage import evaluate_model

    study = make_study(tmp_path / "s", "classification", tiny_bert_dir, task={"labels": LABELS})
    model, tok, base = load(study, LABELS)
    record, preds = evaluate_model(model, tok, base, study, cls_examples(), "validation")
    merge = record["merge"]
    assert merge["copy"] is True and merge["merged"] is False, merge
    assert merge["packed"]["linears"] == sum(type(m).__name__ == "Linear" for m in model.modules())
    assert merge["max_diff"] <= merge["atol"]
    _, loaded = evaluate_model(model, tok, base, study, cls_examples(), "validation", merge=False)
    for a, b in zip(preds, loaded, strict=True):
        assert a["prediction"] == b["prediction"]
        assert max(abs(a["scores"][k] - b["scores"][k]) for k in LABELS) <= 2e-4


def test_packing_is_refused_when_the_free_memory_cannot_hold_it(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """The packed weights are a second copy of every linear weight: with too little memory
    free the baseline runs on the model as loaded and the record says why."""
    from tunelab.core import env
    from tunelab.lib.inference.packed_linear import packed_bytes
    from tunelab.stages.evaluate.stage import evaluate_model

    assert env.available_memory_bytes() > 0  # read from /proc/meminfo on this Linux machine
    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, base = load(study)
    monkeypatch.setattr(env, "available_memory_bytes", lambda: packed_bytes(model))
    record, _ = evaluate_model(model, tok, base, study, extraction_examples(), "validation")
    merge = record["merge"]
    assert merge["copy"] is False and merge["packed"]["linears"] == 0
    assert "need twice that free" in merge["packed"]["reason"]


def test_the_teacher_forced_check_finds_an_output_that_is_not_greedy(tmp_path, tiny_llama_dir):
    from transformers import GenerationConfig

    from tunelab.lib.inference.generation import Generated, _generate_batch, greedy_agreement
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, base = load(study)
    model = lora(study, model, base)
    pre = Preprocessor(tok, study.config, get_task(study.config), "causal_lm")
    prompts = [pre.prompt_ids(ex, generate=8) for ex in extraction_examples()[:3]]
    config = GenerationConfig(
        max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=2
    )
    got = _generate_batch(model, tok, prompts, config, False, False)
    assert greedy_agreement(model, tok, prompts, got)[0]
    changed = [list(t) for t in got.tokens]
    row = next(i for i, t in enumerate(changed) if t)
    changed[row][-1] = (changed[row][-1] + 1) % 500
    same, _, detail = greedy_agreement(model, tok, prompts, Generated(changed, got.ends, {}))
    assert not same and detail.startswith("1 of 3 outputs not greedy")


def _all_linear_lora_classifier(root, model_dir):
    """(study, model, tokenizer, base): a causal-LM classifier with LoRA on every linear layer
    and no module saved whole, its adapter moved off zero (`lora`)."""
    study = causal_classifier(
        root, model_dir, adaptation={"target_modules": "all-linear", "modules_to_save": []}
    )
    model, tok, base = load(study)
    return study, lora(study, model, base), tok, base


def test_label_scores_merged_stay_within_the_tolerance(tmp_path, tiny_llama_dir):
    from tunelab.stages.evaluate.stage import evaluate_model
    from tunelab.stages.verify.stage import SCORE_ATOL

    study, model, tok, base = _all_linear_lora_classifier(tmp_path / "s", tiny_llama_dir)
    record, preds = evaluate_model(model, tok, base, study, cls_examples(), "validation")
    _, unmerged = evaluate_model(model, tok, base, study, cls_examples(), "validation", merge=False)
    merge = record["merge"]
    assert merge["merged"] is True and merge["atol"] == SCORE_ATOL["fp32"]
    assert merge["max_diff"] <= merge["atol"]
    for a, b in zip(preds, unmerged, strict=True):
        assert a["prediction"] == b["prediction"]
        assert max(abs(a["scores"][k] - b["scores"][k]) for k in LABELS) <= 2e-4


def test_a_first_batch_that_differs_falls_back_to_the_unmerged_model(tmp_path, tiny_llama_dir):
    """No score can be within a negative tolerance: the check fails, the copy is dropped and
    every batch runs on the model as loaded."""
    from tunelab.lib.inference.eval_copy import EvalModels
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.predict import Ticker, predict_rows
    from tunelab.stages.evaluate.stage import merge_atol

    study, model, tok, base = _all_linear_lora_classifier(tmp_path / "s", tiny_llama_dir)
    task = get_task(study.config, LABELS)
    pre = Preprocessor(tok, study.config, task, "causal_lm")
    rows = cls_examples()
    models = EvalModels.prepare(model, None, -1.0, 4)
    got = predict_rows(models, tok, pre, task, study.config, rows, "causal_lm", Ticker(None, 7, ""))
    assert models.record["merged"] is False
    assert models.record["reason"].startswith(
        "first batch differed on the copy: max score difference"
    )
    assert models.current is model
    want = predict_rows(model, tok, pre, task, study.config, rows, "causal_lm", lambda n: None)
    assert [p["scores"] for p in got] == [p["scores"] for p in want]
    assert merge_atol(study.config) == 2e-4


# ---------------------------------------------------------------- the end of the answer


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1} and more {"b": 2}',
        'Sure: {"a": "x}y", "n": {"m": [1, {"k": 2}]}} trailing',
        '{not json} then {"a": 1}\n```',
        '```json\n{"a": {"b": 1}}\n``` done',
        '[{"a": 1}, {"b": 2}] words',
        '{"a": 1',
        "no json at all",
    ],
)
def test_an_answer_is_complete_only_where_no_continuation_changes_it(text):
    """At every prefix where `answer_complete` holds, the reader reads what it reads in the
    whole text: stopping there never changes a verdict."""
    from tunelab.lib.tasks.json_text import answer_complete, find_json_object

    whole = find_json_object(text)
    complete = [i for i in range(len(text) + 1) if answer_complete(text[:i])]
    for i in complete:
        assert find_json_object(text[:i]).value == whole.value
        assert find_json_object(text[:i]).failure is None
    if whole.failure is None and not text.startswith("["):
        assert complete and complete[0] == whole.end  # it stops at the closing brace
    else:
        assert not complete


def rambling_model(study, model, tok, base, examples):
    """The tiny model trained until it answers each example with its JSON target followed by
    more words: an answer that ends before the model stops talking."""
    import torch

    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    pre = Preprocessor(tok, study.config, get_task(study.config), "causal_lm")
    encoded = [pre.encode_with_target(ex, ex["target"] + TRAILING) for ex in examples]
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    model.train()
    for _ in range(60):
        for enc in encoded:
            ids = torch.tensor([enc["input_ids"]])
            loss = model(input_ids=ids, labels=torch.tensor([enc["labels"]])).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), pre


@pytest.mark.slow
def test_generation_stops_at_the_answer_with_the_outputs_of_plain_greedy(tmp_path, tiny_llama_dir):
    import torch

    from tunelab.lib.tasks.json_text import answer_complete
    from tunelab.stages.evaluate.stage import evaluate_model, pad_id_for

    study = make_study(
        tmp_path / "s", "extraction", tiny_llama_dir, evaluation={"max_new_tokens": 48}
    )
    model, tok, base = load(study)
    examples = extraction_examples()
    model, pre = rambling_model(study, model, tok, base, examples)
    record, preds = evaluate_model(model, tok, base, study, examples, "validation")
    # plain greedy decoding of each prompt alone, in the split's order, cut where the answer ends
    plain = []
    for ex in examples:
        ids = torch.tensor([pre.prompt_ids(ex, generate=48)])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, max_new_tokens=48, do_sample=False, pad_token_id=pad_id_for(tok)
            )
        new = out[0, ids.shape[1] :].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        for k in range(1, len(new) + 1):
            if answer_complete(tok.decode(new[:k], skip_special_tokens=True)):
                new = new[:k]
                break
        plain.append(tok.decode(new, skip_special_tokens=True))
    assert [p["raw_output"] for p in preds] == plain
    learned = [p for p in preds if p["verdicts"]["json_valid"]]
    assert len(learned) >= 4, [p["raw_output"] for p in preds]
    assert all(TRAILING.strip() not in p["raw_output"] for p in learned)
    # the batches ended with their answers, long before the budget
    assert all(b["steps"] < 48 for b in record["generation"]["batches"])


# ---------------------------------------------------------------- threads


def test_evaluation_threads_are_their_own_setting_outside_the_locked_spec(tmp_path, tiny_llama_dir):
    import os

    import torch

    from tunelab.core.config import validate_config
    from tunelab.core.env import free_cores
    from tunelab.stages.evaluate.stage import set_evaluation_threads

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    raw = study.config.to_dict()
    raw["evaluation"]["num_threads"] = 1
    pinned = validate_config(raw)
    assert pinned.evaluation_spec() == study.config.evaluation_spec()
    before = torch.get_num_threads()
    try:
        assert set_evaluation_threads(pinned) == "evaluation.num_threads"
        assert torch.get_num_threads() == 1
        cores, how = free_cores()
        assert 1 <= cores <= len(os.sched_getaffinity(0))
        assert set_evaluation_threads(study.config).startswith("free cores (")
        assert 1 <= torch.get_num_threads() <= len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


def test_free_cores_count_other_processes_running_now_not_this_ones_past(tmp_path):
    """A spinning process is counted as soon as it runs; this process's own earlier work (which
    the 1-minute load average would still hold) is not."""
    import subprocess
    import sys
    import time

    from tunelab.core.env import free_cores, others_runnable

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert others_runnable() >= 1
        cores, how = free_cores()
        assert "other runnable" in how and cores >= 1
    finally:
        spin.kill()
        spin.wait()
    busy_until = time.perf_counter() + 1.0
    while time.perf_counter() < busy_until:  # this process's own work, just before
        pass
    cores, how = free_cores()
    assert cores >= 1 and "load" not in how
