"""Greedy decoding with the in-place cache and prompt-lookup drafts (tunelab.lib.inference.decoding)."""

from __future__ import annotations

import pytest

from tunelab.lib.inference.decoding import SEPARATOR, lookup_draft


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_tail():
    # "7 8" occurs twice before the tail: the latest occurrence is followed by 5 6
    seq = [1, 7, 8, 2, 3, 7, 8, 5, 6, 9, 7, 8]
    assert lookup_draft(seq, 2) == [5, 6]
    assert lookup_draft(seq, 10) == [5, 6, 9, 7, 8]
    # the 3-token tail "9 7 8" never occurred before, the 2-token one did
    assert lookup_draft(seq, 1, n_max=3) == [5]
    # no earlier occurrence of even the last token: nothing proposed
    assert lookup_draft([1, 2, 3, 4], 4) == []
    assert lookup_draft([4], 4) == []
    assert lookup_draft(seq, 0) == []


def test_a_draft_stops_at_a_separator():
    seq = [5, 6, SEPARATOR, 1, 2, 5]
    assert lookup_draft(seq, 4) == [6]
    assert lookup_draft([5, SEPARATOR, 5], 4) == []


def _model_and_prompts(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = [
        "copy: alpha beta gamma delta alpha beta gamma delta",
        "From: ann@example.org Subject: the minutes",
        "a b a b a b a b",
        "x",
    ]
    return model, tok, [tok(t)["input_ids"] for t in texts]


def _alone(model, tok, prompt, budget):
    """Plain `generate` of one prompt, cut at EOS."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=budget,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def _decode(model, tok, prompts, budget, **options):
    """`decode` of `prompts` on a fresh in-place cache, padded and ended as evaluation does."""
    from tunelab.lib.inference.decoding import decode, in_place_cache
    from tunelab.lib.inference.generation import pad_id_for

    return decode(
        model,
        in_place_cache(model),
        prompts,
        max_new_tokens=budget,
        pad_id=pad_id_for(tok),
        eos_id=tok.eos_token_id,
        **options,
    )


@pytest.mark.parametrize("draft_tokens", [0, 1, 4])
def test_drafted_decoding_emits_what_plain_greedy_emits(tiny_llama_dir, draft_tokens):
    model, tok, prompts = _model_and_prompts(tiny_llama_dir)
    budget = 24
    # the lookup source holds what an earlier answer wrote: the rows may copy it too
    lookup = [*_alone(model, tok, prompts[0], budget), SEPARATOR]
    got = _decode(model, tok, prompts, budget, lookup=lookup, draft_tokens=draft_tokens)
    assert got.tokens == [_alone(model, tok, p, budget) for p in prompts]
    s = got.stats
    assert s["steps"] == max(
        len(t) + (e == "eos") for t, e in zip(got.tokens, got.ends, strict=True)
    )
    if draft_tokens == 0:
        assert s["proposed"] == 0 and s["forwards"] == s["steps"] - 1
    else:
        # a random tiny model repeats itself: its drafts are kept and save forward passes
        assert s["kept"] > 0 and s["forwards"] < s["steps"] - 1, s


def test_a_row_ends_where_its_answer_ends_inside_a_kept_draft(tiny_llama_dir):
    model, tok, prompts = _model_and_prompts(tiny_llama_dir)
    full = [_alone(model, tok, p, 24) for p in prompts]
    cut = {i: len(t) // 2 for i, t in enumerate(full) if len(t) > 3}

    def answered_at(tokens):  # a row's answer ends after half its plain output
        return any(tokens == full[i][:k] for i, k in cut.items())

    got = _decode(model, tok, prompts, 24, answered=answered_at, draft_tokens=4)
    for i, tokens in enumerate(got.tokens):
        if i in cut:
            assert tokens == full[i][: cut[i]] and got.ends[i] == "answer"
        else:
            assert tokens == full[i]


def test_a_sliding_window_cache_is_left_to_generate(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from tunelab.lib.inference.decoding import in_place_cache

    config = MistralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    assert in_place_cache(MistralForCausalLM(config)) is None
    config.sliding_window = None
    assert in_place_cache(MistralForCausalLM(config)) is not None


def test_an_evaluation_with_drafts_predicts_what_one_without_predicts(tmp_path, tiny_llama_dir):
    from helpers.evaluate import extraction_examples, load, make_study
    from tunelab.stages.evaluate.stage import evaluate_model

    preds, batches = {}, {}
    for drafts in (0, 4):
        study = make_study(
            tmp_path / f"s{drafts}",
            "extraction",
            tiny_llama_dir,
            evaluation={"max_new_tokens": 16, "draft_tokens": drafts},
        )
        model, tok, base = load(study)
        record, got = evaluate_model(model, tok, base, study, extraction_examples(), "validation")
        preds[drafts] = [p["raw_output"] for p in got]
        batches[drafts] = record["generation"]["batches"]
        # a speed setting: the locked evaluation spec is the same with and without drafts
        spec = study.config.evaluation_spec()["evaluation"]
        assert "draft_tokens" not in spec
    assert preds[4] == preds[0]
    # the chat template's shared start is computed once: both decode after it
    assert all(b["prefix_tokens"] >= 8 for b in batches[0] + batches[4])
    assert all(b["proposed"] == 0 and b["forwards"] == b["steps"] - 1 for b in batches[0])
    assert all(b["forwards"] <= b["steps"] - 1 for b in batches[4])
    assert [b["steps"] for b in batches[4]] == [b["steps"] for b in batches[0]]


def test_the_shared_prefix_is_what_every_prompt_starts_with_less_one_token():
    from tunelab.lib.inference.decoding import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 5]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # each keeps a token of its own
    assert shared_prefix_length([[1, 2], [3, 2]]) == 0
    assert shared_prefix_length([[7]]) == 0
    assert shared_prefix_length([]) == 0


@pytest.mark.parametrize("draft_tokens", [0, 3])
def test_decoding_after_a_shared_prefix_emits_what_each_prompt_alone_emits(
    tiny_llama_dir, draft_tokens
):
    from tunelab.lib.inference.decoding import prefix_states, shared_prefix_length

    model, tok, prompts = _model_and_prompts(tiny_llama_dir)
    head = tok("Answer in one line. The text:")["input_ids"]
    # rows of different lengths after the prefix: their padding sits between it and them
    rows = [head + p[1:] for p in prompts]
    shared = shared_prefix_length(rows)
    assert shared >= len(head) - 1
    prefix = prefix_states(model, rows[0][:shared])
    got = _decode(model, tok, rows, 16, draft_tokens=draft_tokens, prefix=prefix)
    assert got.tokens == [_alone(model, tok, r, 16) for r in rows]
    assert got.stats["prefix_tokens"] == shared


def test_the_check_after_a_shared_prefix_judges_as_the_whole_prompts_do(tiny_llama_dir):
    from tunelab.lib.inference.decoding import Generated, prefix_states, shared_prefix_length
    from tunelab.lib.inference.generation import greedy_agreement

    model, tok, prompts = _model_and_prompts(tiny_llama_dir)
    head = tok("Answer in one line. The text:")["input_ids"]
    rows = [head + p[1:] for p in prompts]
    prefix = prefix_states(model, rows[0][: shared_prefix_length(rows)])
    outs = [_alone(model, tok, r, 12) for r in rows]
    ends = ["eos" if len(o) < 12 else "budget" for o in outs]
    right = Generated(outs, ends)
    assert greedy_agreement(model, tok, rows, right, prefix)[0]
    assert greedy_agreement(model, tok, rows, right)[0]
    wrong = Generated([o[:-1] + [(o[-1] + 1) % 64] if o else [5] for o in outs], ends)
    assert not greedy_agreement(model, tok, rows, wrong, prefix)[0]
    assert not greedy_agreement(model, tok, rows, wrong)[0]
