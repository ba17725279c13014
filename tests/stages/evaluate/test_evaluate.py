"""Batched inference on tiny models (equal to one-at-a-time), judging outputs, records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from helpers import run_cli
from helpers.evaluate import (
    LABELS,
    TEXTS,
    causal_classifier,
    cls_examples,
    extraction_examples,
    load,
    make_study,
)
from helpers.study import build_study
from tunelab.core.study import Study
from tunelab.lib import metrics as M
from tunelab.stages.data import load_snapshot
from tunelab.stages.hypothesis import stage as hyp
from tunelab.stages.hypothesis.template import render_study_yaml

# ---------------------------------------------------------------- encoder classification


def test_encoder_classification_batched_equals_single(tmp_path, tiny_bert_dir):
    import torch

    from tunelab.stages.evaluate.stage import evaluate_model

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
    from tunelab.core.errors import EvaluationError
    from tunelab.stages.evaluate.stage import evaluate_model

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
    from tunelab.core.errors import HypothesisError
    from tunelab.stages.evaluate.stage import evaluate_model

    study = make_study(tmp_path / "s", "classification", tiny_bert_dir, task={"labels": LABELS})
    model, tok, base = load(study, LABELS)
    drifted = Study.open(study.root, ["evaluation.batch_size=2"])
    with pytest.raises(HypothesisError, match="evaluation.batch_size"):
        evaluate_model(model, tok, base, drifted, cls_examples(), "validation")


def test_evaluation_refuses_another_template_than_training(tmp_path, tiny_bert_dir):
    from tunelab.core.errors import PreprocessError
    from tunelab.stages.evaluate.stage import evaluate_model

    study = make_study(tmp_path / "s", "classification", tiny_bert_dir, task={"labels": LABELS})
    model, tok, base = load(study, LABELS)
    with pytest.raises(PreprocessError, match="template mismatch"):
        evaluate_model(
            model, tok, base, study, cls_examples(), "validation", expect_template_sha256="0" * 64
        )


# ---------------------------------------------------------------- causal-LM label scoring


def test_causal_label_scores_equal_unpadded_log_likelihood(tmp_path, tiny_llama_dir):
    import torch

    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.stage import evaluate_model

    study = causal_classifier(tmp_path / "s", tiny_llama_dir)
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


def test_generation_batched_left_padding_equals_single(tmp_path, tiny_llama_dir):
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.stage import evaluate_model, generate_outputs

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
    # the generation is timed batch by batch, beside the gold answers' length
    gen = record["generation"]
    assert [b["n"] for b in gen["batches"]] == [3, 2]  # evaluation.batch_size 3
    assert all(1 <= b["steps"] <= 8 for b in gen["batches"])
    # what a model emitting the gold answers (tokens and EOS) would take, capped by the budget;
    # batches are formed from the prompts sorted by length
    prompts = [pre.prompt_ids(ex, generate=8) for ex in examples]
    order = sorted(range(5), key=lambda i: (len(prompts[i]), i))
    answers = [pre.encode(ex)["target_len"] for ex in examples]
    expected = [min(8, max(answers[i] for i in rows)) for rows in (order[:3], order[3:])]
    assert [b["answer_steps"] for b in gen["batches"]] == expected
    assert gen["answer_steps"] == sum(expected)
    assert gen["prefill_s"] > 0 and gen["s_per_step"] > 0


def test_generation_steps_are_the_new_tokens_generate_returns(tmp_path, tiny_llama_dir):
    """The step clock counts what `generate` really produced in each batch, and splits its time
    into the prefill (up to the first new token) and the decoding after it."""
    import torch

    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.stage import generate_outputs, pad_id_for, pad_sequences

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, _ = load(study)
    pre = Preprocessor(tok, study.config, get_task(study.config), "causal_lm")
    prompts = [pre.prompt_ids(ex, generate=8) for ex in extraction_examples()]
    for budget in (1, 3, 8):
        stats: list = []
        generate_outputs(model, tok, prompts, max_new_tokens=budget, batch_size=2, stats=stats)
        assert sorted(i for b in stats for i in b["rows"]) == [0, 1, 2, 3, 4]
        for b in stats:
            ids, mask = pad_sequences([prompts[i] for i in b["rows"]], pad_id_for(tok), left=True)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=budget,
                    do_sample=False,
                    pad_token_id=pad_id_for(tok),
                )
            assert b["steps"] == out.shape[1] - ids.shape[1]
            assert b["prompt_tokens"] == ids.shape[1]
            assert b["prefill_s"] > 0
            assert (b["decode_s"] > 0) == (b["steps"] > 1)


def test_generation_timing_prices_the_longest_answer_of_each_batch():
    from tunelab.lib.probes import generation_timing

    batches = [
        {"rows": [0, 1], "prompt_tokens": 9, "steps": 64, "prefill_s": 2.0, "decode_s": 6.3},
        {"rows": [2], "prompt_tokens": 7, "steps": 11, "prefill_s": 1.0, "decode_s": 1.0},
    ]
    gen = generation_timing(batches, [30, 41, 90], max_new_tokens=64)
    assert [b["answer_steps"] for b in gen["batches"]] == [41, 64]  # the longest, capped
    assert [b["n"] for b in gen["batches"]] == [2, 1]
    assert "rows" not in gen["batches"][0]
    assert gen["steps"] == 75 and gen["answer_steps"] == 105
    assert gen["answers_over_budget"] == 1  # 90 tokens against 64
    assert gen["prefill_s"] == pytest.approx(3.0) and gen["decode_s"] == pytest.approx(7.3)
    assert gen["s_per_step"] == pytest.approx(7.3 / (63 + 10))


# ---------------------------------------------------------------- judging outputs


@pytest.fixture
def extraction_task():
    from tunelab.core.config import validate_config
    from tunelab.lib.tasks import get_task

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
    from tunelab.stages.evaluate.predict import judge_output

    row = judge_output(extraction_task, GOLD_ROW, raw)
    v = row["verdicts"]
    assert (v["json_valid"], v["schema_valid"], row["correct"], v["failure"]) == (
        json_valid,
        schema_valid,
        correct,
        failure,
    )
    assert row["raw_output"] == raw and row["gold"] == {"sender": "a@x.org", "subject": "Hello"}
    if failure in ("parse_error", "empty"):
        # every field is judged, and failed as not JSON
        assert row["prediction"] is None
        assert v["paths"] == {
            f: {"slots": 1, "gold": 1, "not_json": 1} for f in ("sender", "subject")
        }


def test_judge_schema_error_still_scores_present_fields(extraction_task):
    from tunelab.stages.evaluate.predict import judge_output

    row = judge_output(extraction_task, GOLD_ROW, '{"sender": "a@x.org"}')
    paths = row["verdicts"]["paths"]
    assert paths["sender"] == {
        "slots": 1, "present": 1, "exact": 1, "match": 1, "tp": 1, "pred": 1, "gold": 1
    }  # fmt: skip
    assert paths["subject"] == {"slots": 1, "gold": 1, "missing": 1}


def test_rescoring_recorded_rows_reproduces_the_record(extraction_task):
    """Rescoring is a function of the recorded gold and raw output alone."""
    from tunelab.stages.evaluate.predict import judge_output, rescore_predictions
    from tunelab.stages.evaluate.stage import compute_metrics

    raws = ['{"sender": "a@x.org", "subject": "Hello"}\n```', "no", '{"sender": "b"}']
    rows = [
        judge_output(extraction_task, {**GOLD_ROW, "id": str(i)}, r) for i, r in enumerate(raws)
    ]
    again = rescore_predictions(extraction_task, rows)
    assert again == rows
    assert compute_metrics(extraction_task, again) == compute_metrics(extraction_task, rows)


def test_judge_format_outputs():
    from tunelab.core.config import validate_config
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.predict import judge_output
    from tunelab.stages.evaluate.stage import compute_metrics

    task = get_task(validate_config(yaml.safe_load(render_study_yaml("format", "t"))))
    row = {"id": "f", "text": "q", "target": '{"answer": "yes"}'}
    rows = [
        judge_output(task, row, '{"answer": "yes"}'),
        judge_output(task, row, '{"answer": 3}'),
        judge_output(task, row, "yes"),
        judge_output(task, row, '{"answer": "no"}'),
    ]
    assert [r["correct"] for r in rows] == [True, False, False, True]
    m = compute_metrics(task, rows)
    assert m["format_valid_rate"] == 0.5
    assert m["json_valid_rate"] == 0.75
    assert m["exact_match"] == 0.25
    assert m["failure_counts"] == {"parse_error": 1, "schema_error": 1}


# ---------------------------------------------------------------- the stage: baseline, eval, compare


WORDS = (
    "market bank rate profit shares match goal team player season phone chip software data "
    "network film award stage music actor vote party minister budget debate"
).split()


@pytest.fixture(scope="module")
def stage_study(tmp_path_factory, tiny_bert_dir):
    """A registered classification study on the tiny BERT with a data snapshot (60 rows)."""
    import random

    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("stage") / "s"
    root.mkdir()
    rng = random.Random(0)
    rows = [
        {
            "id": f"n{i}",
            "text": f"{LABELS[i % 3]} story {i}: " + " ".join(rng.choice(WORDS) for _ in range(12)),
            "label": LABELS[i % 3],
        }
        for i in range(60)
    ]
    fixed = {
        "data.fields": {"id": "id", "text": "text", "label": "label"},
        "data.cleaning": [],
        "data.splits": {"train": 0.6, "validation": 0.2, "test": 0.2, "seed": 0},
        "adaptation": {"method": "full"},
        "preprocess.max_seq_len": 48,
    }
    training = {
        "micro_batch_size": 4,
        "max_steps": 3,
        "lr": 1e-2,
        "warmup_steps": 0,
        "eval_every_steps": None,
        "checkpoint_every_steps": None,
        "num_threads": 1,
    }
    return build_study(
        root,
        "classification",
        name="stage",
        model_dir=tiny_bert_dir,
        rows=rows,
        data_file="news.jsonl",
        set=fixed,
        training=training,
        evaluation={"batch_size": 8, "bootstrap_samples": 200},
        register=True,
    )


def test_baseline_eval_compare_commands(stage_study, capsys):
    from tunelab.core.records import read_json, read_jsonl
    from tunelab.stages.train import stage as train_stage

    code, out, err = run_cli(capsys, "baseline", "-s", stage_study, "--json")
    assert code == 0, err
    base = json.loads(out)
    study = Study.open(stage_study)
    run_dir = study.runs_dir / base["run_id"]
    assert study.get_run(base["run_id"]).row.kind == "baseline"
    assert read_json(run_dir / "status.json")["status"] == "completed"
    preds = read_jsonl(run_dir / "predictions-validation.jsonl")
    metrics = read_json(run_dir / "metrics-validation.json")
    n_val = len(load_snapshot(study).rows("validation"))
    assert len(preds) == metrics["n"] == n_val >= 10
    assert metrics["load_s"] > 0  # the planner sets it against the smoke's reload
    # the CPU time its threads had: process CPU seconds over wall seconds x threads
    assert metrics["cpu_s"] > 0 and metrics["torch_threads"] >= 1
    assert 0 < metrics["cpu_share"] <= 1.05
    # from the unrounded figures: the record rounds both to 3 decimals, and the tiny model's
    # evaluation takes hundredths of a second, so allow that rounding and no more
    cpu_s, seconds, threads = metrics["cpu_s"], metrics["seconds"], metrics["torch_threads"]
    low = (cpu_s - 0.0005) / ((seconds + 0.0005) * threads) - 0.0005
    high = (cpu_s + 0.0005) / (max(seconds - 0.0005, 1e-9) * threads) + 0.0005
    assert low <= metrics["cpu_share"] <= high
    assert set(metrics["metrics"]["per_category"]) == set(LABELS)
    assert metrics["data_snapshot"] == read_json(run_dir / "config.json")["data_snapshot"]

    # the tables
    code, out, err = run_cli(capsys, "baseline", "-s", stage_study)
    assert code == 0, err
    assert "per category" in out and "confusion" in out and "examples/s" in out

    trained = train_stage.run(Study.open(stage_study), name="v1", why="first")
    code, out, err = run_cli(capsys, "eval", trained.id, "-s", stage_study, "--json")
    assert code == 0, err
    ev = json.loads(out)
    assert ev["evaluates"] == trained.id and ev["spec_sha256"] == base["spec_sha256"]
    eval_row = study.get_run(ev["run_id"]).row
    assert eval_row.kind == "eval" and eval_row.parent == trained.id

    code, out, err = run_cli(capsys, "compare", "-s", stage_study, "--json")
    assert code == 0, err
    rec = json.loads(out)
    (row,) = [r for r in rec["runs"] if r["run_id"] == trained.id]
    assert row["compared"] and row["eval_run"] == ev["run_id"] and row["n_paired"] == n_val
    assert row["config_diff"]["against"] == rec["baseline"]["run_id"]
    assert {g["item"] for g in row["guardrails"]} == set(LABELS)
    assert row["metrics"]["accuracy"]["delta"] == pytest.approx(
        ev["metrics"]["accuracy"] - base["metrics"]["accuracy"]
    )

    # a run that is not completed cannot be evaluated
    failed = study.create_run("train", name="broken")
    failed.set_status("failed", "diverged")
    code, out, err = run_cli(capsys, "eval", failed.id, "-s", stage_study)
    assert code == 2 and "failed (diverged)" in err


def test_test_split_is_sealed_and_openings_are_counted(stage_study, capsys):
    from tunelab.stages.train import stage as train_stage

    code, out, err = run_cli(capsys, "baseline", "-s", stage_study, "--json")
    base_id = json.loads(out)["run_id"]
    study = Study.open(stage_study)
    before = len(study.ledger.test_openings())
    code, out, err = run_cli(capsys, "eval", base_id, "-s", stage_study, "--split", "test")
    assert code == 2 and "sealed" in err and "--final" in err
    assert len(study.ledger.test_openings()) == before
    code, out, err = run_cli(capsys, "eval", base_id, "-s", stage_study, "--final")
    assert code == 2 and "only for the test split" in err

    args = ["eval", base_id, "-s", stage_study, "--split", "test", "--final", "--json"]
    code, out, err = run_cli(capsys, *args, "--why", "final numbers")
    assert code == 0, err
    first = json.loads(out)
    assert first["split"] == "test" and first["test_openings"] == before + 1
    assert "WARNING" not in err and "warning" not in first
    openings = study.ledger.test_openings()
    assert openings[-1].why == "final numbers" and openings[-1].run_id == first["run_id"]

    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    second = json.loads(out)
    assert second["test_openings"] == before + 2
    assert "WARNING" in err and "opened" in second["warning"]
    # compare counts the openings too; it needs an evaluated variant of its own
    trained = train_stage.run(Study.open(stage_study), name="sealed", why="a variant to compare")
    assert run_cli(capsys, "eval", trained.id, "-s", stage_study)[0] == 0
    code, out, err = run_cli(capsys, "compare", "-s", stage_study, "--json")
    assert json.loads(out)["test_openings"] == before + 2 and "WARNING" in err


# ---------------------------------------------------------------- real models and data (slow)


@pytest.mark.slow
def test_real_minilm_baseline_on_bbc(tmp_path, capsys, minilm_dir, bbc_dir):
    from tunelab.core.records import read_json

    root = build_study(
        tmp_path / "bbc",
        example="classification-bbc",
        model={"path": str(minilm_dir)},
        data={
            "source": {
                "format": "folder",
                "path": str(bbc_dir),
                "glob": "*.txt",
                "encoding_errors": "replace",
            },
            "max_examples": 300,
        },
        training={"num_threads": 1},
    )
    assert run_cli(capsys, "register", "-s", root)[0] == 0
    assert run_cli(capsys, "data", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "baseline", "-s", root)
    assert code == 0, err
    labels = ["business", "entertainment", "politics", "sports", "tech"]
    for label in labels:
        assert label in out
    assert "per category" in out and "confusion" in out
    (run_dir,) = (root / "records" / "runs").iterdir()
    rec = read_json(run_dir / "metrics-validation.json")
    m = rec["metrics"]
    assert list(m["per_category"]) == labels
    assert sum(c["support"] for c in m["per_category"].values()) == rec["n"] >= 40
    assert sum(map(sum, m["confusion"]["matrix"])) == rec["n"]
    # an untrained head: the point of the baseline is that it is near chance
    assert 0.0 <= m["accuracy"] <= 0.6 and rec["examples_per_s"] > 0
    print(
        json.dumps(
            {
                "n": rec["n"],
                "examples_per_s": rec["examples_per_s"],
                **{k: m[k] for k in ("accuracy", "macro_f1", "weighted_f1")},
            }
        )
    )


@pytest.mark.slow
def test_real_smollm2_baseline_on_spamassassin_extraction(tmp_path, capsys):
    from tunelab.core.assets import smollm2_gguf
    from tunelab.core.records import read_json, read_jsonl

    folder, gguf = smollm2_gguf()
    repo = Path(__file__).resolve().parents[3]
    emails = repo / "examples" / "extraction-email" / "data" / "emails.jsonl"
    root = build_study(
        tmp_path / "mail",
        example="extraction-email",
        model={"path": str(folder), "gguf_file": gguf},
        data={"source": {"format": "jsonl", "path": str(emails)}, "max_examples": 60},
        evaluation={"max_examples": 3, "max_new_tokens": 32, "batch_size": 3},
        training={"num_threads": 1},
    )
    assert run_cli(capsys, "register", "-s", root)[0] == 0
    assert run_cli(capsys, "data", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "baseline", "-s", root)
    assert code == 0, err
    assert "per field" in out
    for field in ("sender", "subject", "date", "list"):
        assert field in out
    (run_dir,) = (root / "records" / "runs").iterdir()
    rec = read_json(run_dir / "metrics-validation.json")
    preds = read_jsonl(run_dir / "predictions-validation.jsonl")
    assert rec["n"] == len(preds) == 3 and rec["fields"] == ["sender", "subject", "date", "list"]
    m = rec["metrics"]
    assert set(m["per_field"]) == set(rec["fields"])
    for p in preds:
        assert p["raw_output"].strip()  # the model answered something
        assert set(p["gold"]) == set(rec["fields"])
    for key in ("json_valid_rate", "schema_valid_rate", "field_presence_rate", "field_micro_f1"):
        assert 0.0 <= m[key] <= 1.0
    print(
        json.dumps(
            {
                "n": rec["n"],
                "examples_per_s": rec["examples_per_s"],
                **{k: v for k, v in m.items() if k not in ("per_field", "n")},
            }
        )
    )


def test_failure_examples_name_one_example_per_kind():
    from tunelab.cli.evaluate import failure_examples

    rows = [
        {"id": "a", "verdicts": {"failure": None}},
        {"id": "b", "verdicts": {"failure": "no_match"}, "parse_error": "the first line matches"},
        {"id": "c", "verdicts": {"failure": "no_match"}, "parse_error": "other"},
        {"id": "d", "verdicts": {"failure": "empty"}, "parse_error": "the output is empty"},
    ]
    assert failure_examples(rows) == [
        "  no_match, e.g. b: the first line matches",
        "  empty, e.g. d: the output is empty",
    ]
    # an extraction's kinds are the JSON reader's, as the failures table counts them
    extraction = [
        {"id": "e", "verdicts": {"failure": "parse_error", "json_failure": "truncated"}},
        {"id": "f", "verdicts": {"failure": "parse_error", "json_failure": "no_json"}},
        {"id": "g", "verdicts": {"failure": "schema_error", "json_failure": None}},
    ]
    assert [line.split(",")[0].strip() for line in failure_examples(extraction)] == [
        "truncated",
        "no_json",
        "schema_error",
    ]


def test_answers_longer_than_the_budget_are_warned_and_reported(tmp_path, capsys, tiny_llama_dir):
    """An answer longer than evaluation.max_new_tokens can never be generated whole: baseline
    and eval warn, the record counts them, and the dossier lists it among the limitations."""
    study = make_study(
        tmp_path / "s",
        "extraction",
        tiny_llama_dir,
        data={"dedup": {"near": False}, "splits": {"stratify": False, "seed": 0}},
    )
    rows = [
        {
            "text": f"From: user{i}@example.com Subject: {TEXTS[i % len(TEXTS)]} number {i}",
            "target": json.dumps(
                {"sender": f"user{i}@example.com", "subject": f"{TEXTS[i % len(TEXTS)]} {i}"}
            ),
        }
        for i in range(40)
    ]
    (study.root / "data").mkdir()
    (study.root / "data" / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_cli(capsys, "data", "-s", study.root)[0] == 0
    code, out, err = run_cli(capsys, "baseline", "-s", study.root)
    assert code == 0, err
    n = len(load_snapshot(Study.open(study.root)).rows("validation"))
    assert f"{n} of {n} gold answers are longer than evaluation.max_new_tokens (8)" in " ".join(
        err.split()
    )
    from tunelab.core.records import read_json

    (baseline,) = Study.open(study.root).list_runs("baseline")
    record = read_json(Study.open(study.root).runs_dir / baseline.id / "metrics-validation.json")
    # each failure kind with the first example of it and why, beside the counts
    assert record["metrics"]["failure_counts"]
    for kind in record["metrics"]["failure_counts"]:
        assert re.search(rf"^  {kind}, e\.g\. \S+: \S", out, re.M), out
    # decoding steps, batch by batch (a batch steps until its last row ends), not tokens
    gen = record["generation"]
    assert re.search(
        rf"decoding steps +│ {gen['steps']} in {len(gen['batches'])} batches \(the gold", out
    ), out
    assert run_cli(capsys, "report", "-s", study.root)[0] == 0
    md = (study.root / "report" / "dossier.md").read_text()
    assert f"{n} of the {n} evaluated validation answers are longer than" in md


def test_an_unscorable_gold_stops_the_evaluation_before_any_decoding(tmp_path, tiny_llama_dir):
    """A gold that gives a key twice (let in by data.invalid_targets: keep) is named before a
    single answer is generated, not after the whole split is decoded, nor read last-wins."""
    from tunelab.core.errors import DataError
    from tunelab.stages.evaluate.stage import evaluate_model

    study = make_study(tmp_path / "s", "extraction", tiny_llama_dir)
    model, tok, base = load(study)
    examples = extraction_examples()
    examples[-1]["target"] = '{"sender": "a@x.org", "subject": "Hi", "subject": "Re: Hi"}'
    calls = []
    with pytest.raises(DataError, match="'x4'.*key 'subject' given twice"):
        evaluate_model(
            model, tok, base, study, examples, "validation", progress=lambda *a: calls.append(a)
        )
    assert calls == []
