"""Batched inference on tiny models (equal to one-at-a-time), judging outputs, records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import FILLED_HYPOTHESIS
from tunelab import hypothesis as hyp
from tunelab import metrics as M
from tunelab.scaffold import render_study_yaml
from tunelab.study import Study

TEXTS = [
    "Markets rallied as the central bank held interest rates steady.",
    "The striker scored twice in the second half to win the match.",
    "A new smartphone with a faster chip was announced.",
    "The film won the award.",
    "Parliament voted on the new budget after a long debate about taxes and spending plans.",
    "Quick brown fox.",
    "The match ended in a draw.",
]
LABELS = ["business", "sport", "tech"]


def make_study(root: Path, kind: str, model_dir: Path, **sections) -> Study:
    raw = yaml.safe_load(render_study_yaml(kind, "t"))
    raw["hypothesis"] = dict(FILLED_HYPOTHESIS)
    raw["model"]["path"] = str(model_dir)
    raw["model"]["architecture"] = "encoder" if kind == "classification" else "causal_lm"
    raw["preprocess"]["max_seq_len"] = 96
    raw["evaluation"]["batch_size"] = 3
    raw["evaluation"]["max_new_tokens"] = 8
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    study = Study.open(root)
    hyp.register(study.root, study.config)
    return study


def cls_examples():
    return [
        {"id": f"e{i}", "text": t, "label": LABELS[i % 3], "target": None}
        for i, t in enumerate(TEXTS)
    ]


def load(study, labels=None):
    from tunelab.models import load_model, load_tokenizer, resolve_base

    base = resolve_base(study)
    tok = load_tokenizer(base)
    return load_model(base, study.config, labels=labels), tok, base


# ---------------------------------------------------------------- encoder classification


def test_encoder_classification_batched_equals_single(tmp_path, tiny_bert_dir):
    import torch

    from tunelab.evaluate import evaluate_model

    study = make_study(tmp_path / "s", "classification", tiny_bert_dir, task={"labels": LABELS})
    model, tok, base = load(study, LABELS)
    record, preds = evaluate_model(model, tok, base, study, cls_examples(), "validation")
    assert [p["id"] for p in preds] == [f"e{i}" for i in range(len(TEXTS))]
    # one example at a time, no padding: the same labels and probabilities
    for ex, p in zip(cls_examples(), preds, strict=True):
        enc = tok(ex["text"], truncation=True, max_length=96, return_tensors="pt")
        with torch.no_grad():
            probs = torch.softmax(model(**enc).logits[0], -1).tolist()
        assert p["prediction"] == LABELS[max(range(3), key=lambda j: probs[j])]
        assert [p["scores"][c] for c in LABELS] == pytest.approx(probs, abs=1e-5)
        assert p["correct"] == (p["prediction"] == ex["label"])
    expected = M.classification_metrics(
        [p["gold"] for p in preds], [p["prediction"] for p in preds], LABELS
    )
    assert record["metrics"] == expected
    assert record["n"] == len(TEXTS) and record["task_kind"] == "classification"
    assert record["labels"] == LABELS and record["examples_per_s"] > 0
    locked = hyp.require_hypothesis(study.root, study.config)
    assert record["evaluation_spec_sha256"] == locked["evaluation_spec_sha256"]
    assert len(record["spec_sha256"]) == 64 and record["spec_sha256"] != locked["sha256"]


def test_max_examples_and_empty_split(tmp_path, tiny_bert_dir):
    from tunelab.errors import EvaluationError
    from tunelab.evaluate import evaluate_model

    study = make_study(
        tmp_path / "s",
        "classification",
        tiny_bert_dir,
        task={"labels": LABELS},
        evaluation={"max_examples": 4},
    )
    model, tok, base = load(study, LABELS)
    record, preds = evaluate_model(model, tok, base, study, cls_examples(), "validation")
    assert record["n"] == 4 and [p["id"] for p in preds] == ["e0", "e1", "e2", "e3"]
    with pytest.raises(EvaluationError, match="no examples"):
        evaluate_model(model, tok, base, study, [], "validation")


def test_evaluation_refuses_a_drifted_study(tmp_path, tiny_bert_dir):
    from tunelab.errors import HypothesisError
    from tunelab.evaluate import evaluate_model

    study = make_study(tmp_path / "s", "classification", tiny_bert_dir, task={"labels": LABELS})
    model, tok, base = load(study, LABELS)
    drifted = Study.open(study.root, ["evaluation.batch_size=2"])
    with pytest.raises(HypothesisError, match="evaluation.batch_size"):
        evaluate_model(model, tok, base, drifted, cls_examples(), "validation")


# ---------------------------------------------------------------- causal-LM label scoring


def test_causal_label_scores_equal_unpadded_log_likelihood(tmp_path, tiny_llama_dir):
    import torch

    from tunelab.evaluate import evaluate_model
    from tunelab.preprocess import Preprocessor
    from tunelab.tasks import get_task

    study = make_study(
        tmp_path / "s",
        "classification",
        tiny_llama_dir,
        task={"labels": LABELS},
        model={"architecture": "causal_lm"},
    )
    model, tok, base = load(study)
    record, preds = evaluate_model(model, tok, base, study, cls_examples(), "validation")
    pre = Preprocessor(tok, study.config, get_task(study.config, LABELS), "causal_lm")
    for ex, p in zip(cls_examples(), preds, strict=True):
        for label in LABELS:
            enc = pre.encode({**ex, "label": label})
            ids = torch.tensor([enc["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            want = sum(
                logp[t - 1, enc["input_ids"][t]].item()
                for t, lab in enumerate(enc["labels"])
                if lab != -100
            )
            assert p["scores"][label] == pytest.approx(want, abs=1e-3)
        assert p["prediction"] == max(LABELS, key=lambda c: p["scores"][c])
    assert record["architecture"] == "causal_lm"
    assert set(record["metrics"]) >= {"accuracy", "macro_f1", "per_category", "confusion"}


# ---------------------------------------------------------------- generation


def extraction_examples():
    out = []
    for i, t in enumerate(TEXTS[:5]):
        target = {"sender": f"user{i}@example.com", "subject": t[:20]}
        out.append(
            {
                "id": f"x{i}",
                "text": f"From: user{i}@example.com {t}",
                "label": None,
                "target": json.dumps(target),
            }
        )
    return out


def test_generation_batched_left_padding_equals_single(tmp_path, tiny_llama_dir):
    from tunelab.evaluate import evaluate_model, generate_outputs
    from tunelab.preprocess import Preprocessor
    from tunelab.tasks import get_task

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, base = load(study)
    examples = extraction_examples()
    record, preds = evaluate_model(model, tok, base, study, examples, "validation")
    pre = Preprocessor(tok, study.config, get_task(study.config), "causal_lm")
    alone = [
        generate_outputs(model, tok, [pre.prompt_ids(ex)], max_new_tokens=8, batch_size=1)[0]
        for ex in examples
    ]
    assert [p["raw_output"] for p in preds] == alone
    assert all(len(tok(p["raw_output"])["input_ids"]) <= 8 for p in preds)
    m = record["metrics"]
    assert set(m["per_field"]) == {"sender", "subject"}
    for key in ("json_valid_rate", "schema_valid_rate", "field_presence_rate", "field_micro_f1"):
        assert 0.0 <= m[key] <= 1.0
    assert record["fields"] == ["sender", "subject"]


# ---------------------------------------------------------------- judging outputs


@pytest.fixture
def extraction_task():
    from tunelab.config import validate_config
    from tunelab.tasks import get_task

    raw = yaml.safe_load(render_study_yaml("extraction", "t"))
    return get_task(validate_config(raw))


GOLD_ROW = {
    "id": "g",
    "text": "From: a@x.org",
    "target": json.dumps({"sender": "a@x.org", "subject": "Hello"}),
}


@pytest.mark.parametrize(
    "raw,json_valid,schema_valid,correct,failure",
    [
        ('{"sender": "a@x.org", "subject": "Hello"}', True, True, True, None),
        # code fence with a language tag
        ('```json\n{"sender": "a@x.org", "subject": "Hello"}\n```', True, True, True, None),
        # trailing text after the object
        ('{"sender": "A@x.org", "subject": "hello"} Hope this helps!', True, True, True, None),
        # broken JSON
        ('{"sender": "a@x.org", "subject": "Hel', False, False, False, "parse_error"),
        ("I cannot find the sender.", False, False, False, "parse_error"),
        ('{"sender": "a@x.org"}', True, False, False, "schema_error"),
        ("", False, False, False, "empty"),
    ],
)
def test_judge_extraction_outputs(extraction_task, raw, json_valid, schema_valid, correct, failure):
    from tunelab.evaluate import _judge

    row = _judge(extraction_task, GOLD_ROW, raw)
    v = row["verdicts"]
    assert (v["json_valid"], v["schema_valid"], row["correct"], v["failure"]) == (
        json_valid,
        schema_valid,
        correct,
        failure,
    )
    assert row["raw_output"] == raw and row["gold"] == {"sender": "a@x.org", "subject": "Hello"}
    if failure in ("parse_error", "empty"):
        assert row["prediction"] is None and not any(v["presence"].values())


def test_judge_schema_error_still_scores_present_fields(extraction_task):
    from tunelab.evaluate import _judge

    row = _judge(extraction_task, GOLD_ROW, '{"sender": "a@x.org"}')
    assert row["verdicts"]["presence"] == {"sender": True, "subject": False}
    assert row["verdicts"]["normalized"] == {"sender": True, "subject": False}
    assert row["verdicts"]["tp"] == 1


def test_judge_format_outputs():
    from tunelab.config import validate_config
    from tunelab.evaluate import _judge, compute_metrics
    from tunelab.tasks import get_task

    task = get_task(validate_config(yaml.safe_load(render_study_yaml("format", "t"))))
    row = {"id": "f", "text": "q", "target": '{"answer": "yes"}'}
    rows = [
        _judge(task, row, '{"answer": "yes"}'),
        _judge(task, row, '{"answer": 3}'),
        _judge(task, row, "yes"),
        _judge(task, row, '{"answer": "no"}'),
    ]
    assert [r["correct"] for r in rows] == [True, False, False, True]
    m = compute_metrics(task, rows)
    assert m["format_valid_rate"] == 0.5
    assert m["json_valid_rate"] == 0.75
    assert m["exact_match"] == 0.25
    assert m["failure_counts"] == {"parse_error": 1, "schema_error": 1}
