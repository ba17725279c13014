"""core/record_types: a record reads back typed, and a damaged one raises one located error."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from tunelab.core.errors import StudyError
from tunelab.core.record_types import Evaluation, RunConfig, RunStatus, Verify
from tunelab.core.study import Study


@pytest.fixture
def run(tmp_path, capsys):
    code, _, err = run_cli(capsys, "init", tmp_path / "s", "--task", "classification")
    assert code == 0, err
    study = Study.open(tmp_path / "s")
    return study.create_run("baseline", name="base", extra={"labels": ["ham", "spam"]})


def test_a_run_reads_back_its_config_typed_and_validated_once(run):
    record = run.record
    assert isinstance(record, RunConfig)
    assert (record.run_id, record.kind, record.name, record.labels) == (
        run.id, "baseline", "base", ["ham", "spam"],
    )  # fmt: skip
    assert record.config_sha256 == run.study.config.sha256()
    assert run.config.sha256() == record.config_sha256
    assert run.config is run.config  # validated once per Run
    assert record.training.seed == run.config.training.seed
    status = run.last_status()
    assert isinstance(status, RunStatus) and status.status == "running"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"run_id": "x"', r"config\.json: not valid JSON \(line 1\): the record is damaged"),
        ("[1, 2]", r"config\.json: a list, not a JSON object: the record is damaged"),
        ("{}", r"config\.json: field 'run_id' is missing: the record is damaged"),
    ],
)
def test_a_damaged_config_raises_the_located_error(run, text, error):
    (run.dir / "config.json").write_text(text)
    with pytest.raises(StudyError, match=error):
        run.record  # noqa: B018 - reading is the test


def test_a_field_of_the_wrong_type_is_named(tmp_path):
    path = tmp_path / "metrics-validation.json"
    path.write_text(json.dumps({"split": "validation", "n": "12", "metrics": {}}))
    with pytest.raises(StudyError, match=r"field 'n' is '12', not int: the record is damaged"):
        Evaluation.read(path)
    path.write_text(json.dumps({"split": "validation", "n": 12, "metrics": {"accuracy": 0.5}}))
    ev = Evaluation.read(path)
    assert (ev.n, ev.metrics, ev.seconds, ev.get("absent", 7)) == (12, {"accuracy": 0.5}, None, 7)
    verify = tmp_path / "verify-1.json"
    verify.write_text(json.dumps({"passed": 1}))  # 1 is not true/false
    with pytest.raises(StudyError, match=r"field 'passed' is 1, not true/false"):
        Verify.read(verify)


def test_every_record_of_the_fixed_study_reads_as_its_kind():
    """The typed classes read the records tunelab writes (the fixed study of the pinned plan)."""
    from pathlib import Path

    from tunelab.core.record_data import DataManifest, Duplicates
    from tunelab.core.record_types import (
        Compare,
        ExportManifest,
        Plan,
        Sizing,
        Smoke,
    )
    from tunelab.core.run_parts import ParameterAudit, RunEnv

    records = Path(__file__).parents[1] / "fixtures" / "plan-study" / "records"
    kinds = {
        "runs/*/config.json": RunConfig,
        "runs/*/status.json": RunStatus,
        "runs/*/metrics-*.json": Evaluation,
        "runs/*/smoke.json": Smoke,
        "runs/*/verify-*.json": Verify,
        "sizing/size-*.json": Sizing,
        "plans/plan-*.json": Plan,
        "compare/*.json": Compare,
        "exports/*/tunelab-manifest.json": ExportManifest,
        "data/*/manifest.json": DataManifest,
        "data/*/duplicates.json": Duplicates,
        "runs/*/env.json": RunEnv,
        "runs/train-*/audit.json": ParameterAudit,
    }
    for pattern, kind in kinds.items():
        paths = sorted(records.glob(pattern))
        assert paths, pattern
        for path in paths:
            assert kind.read(path).path == path
    smoke = Smoke.read(next(records.glob("runs/*/smoke.json")))
    assert smoke.passed is True and smoke.step_s > 0 and smoke.checks


def test_a_comparison_reads_typed_to_its_guardrail_verdicts_and_locates_a_damaged_piece():
    import re

    from tunelab.core.record_types import Compare

    record = {
        "id": "c1",
        "baseline": {"run_id": "baseline-1"},
        "runs": [
            {
                "run_id": "train-1",
                "compared": True,
                "primary": {"delta": 0.1},
                "guardrails": [{"rule": "f1 >= baseline - 0.02", "pass": True}],
                "per_category": {"sport": {"f1": {"delta": -0.01, "ci_low": -0.03}}},
            }
        ],
    }
    compare = Compare.of("compare/c1.json", record)
    (entry,) = compare.runs
    assert entry.primary.delta == 0.1 and entry.guardrails[0].passed
    assert entry.guardrails[0].outcome == "pass"
    assert entry.per_category["sport"]["f1"].ci_low == -0.03
    assert compare.lists("baseline-1") and compare.lists("train-1") and not compare.lists("x")
    damaged = [
        ({"guardrails": [{"rule": "r"}]}, "runs[0].guardrails[0]: field 'pass' is missing"),
        ({"per_category": {"sport": {"f1": {"delta": "x"}}}}, "runs[0].per_category.sport.f1"),
        ({"primary": 3}, "runs[0].primary: a int, not a JSON object"),
    ]
    for change, where in damaged:
        bad = {**record, "runs": [{**record["runs"][0], **change}]}
        with pytest.raises(StudyError, match=re.escape(f"compare/c1.json: {where}")):
            Compare.of("compare/c1.json", bad)


def test_a_sizing_row_and_an_evaluation_table_read_typed_with_their_place_named():
    import re

    from tunelab.core.record_types import Evaluation, Sizing

    sizing = {"id": "size-1", "device": "cpu", "configurations": [{"label": "lora", "seq_len": 64}]}
    (row,) = Sizing.of("sizing/size-1.json", sizing).rows
    assert row.title == "lora" and row.seq_len == 64 and row.measured_peak_mb is None
    bad = {**sizing, "configurations": [{"label": "lora", "seq_len": "64"}]}
    where = "sizing/size-1.json: configurations[0]: field 'seq_len' is '64'"
    with pytest.raises(StudyError, match=re.escape(where)):
        _ = Sizing.of("sizing/size-1.json", bad).rows
    metrics = {"per_category": {"sport": {"f1": 0.5, "support": 3}}, "confusion": {"labels": []}}
    with pytest.raises(StudyError, match=re.escape("metrics.confusion: field 'predicted'")):
        Evaluation.of(
            "metrics-validation.json", {"split": "validation", "n": 3, "metrics": metrics}
        )
    ok = {**metrics, "confusion": {"labels": ["sport"], "predicted": ["sport"], "matrix": [[3]]}}
    ev = Evaluation.of("metrics-validation.json", {"split": "validation", "n": 3, "metrics": ok})
    assert ev.per_category["sport"].support == 3 and ev.confusion.matrix == [[3]]


def test_a_kind_declares_each_field_once_and_its_annotation_is_the_check(tmp_path):
    from dataclasses import dataclass

    from tunelab.core.record_base import Record, field_types

    @dataclass(frozen=True)
    class Piece(Record):
        name: str = ""
        size: float | None = None
        tags: list[str] | None = None

    assert field_types(Piece) == {
        "name": (str,),
        "size": (int, float, type(None)),
        "tags": (list, type(None)),
    }
    assert Piece.of(tmp_path, {"name": "a", "size": 3}).size == 3  # an int is a float too
    with pytest.raises(StudyError, match=r"field 'name' is missing"):
        Piece.of(tmp_path, {"size": 1.5})
    with pytest.raises(StudyError, match=r"field 'size' is True, not int or float"):
        Piece.of(tmp_path, {"name": "a", "size": True})
    with pytest.raises(TypeError, match="declare each field once"):

        class Twice(Record):
            FIELDS = {"name": (str,)}


def test_a_data_manifest_reads_typed_and_a_damaged_piece_is_located(tmp_path):
    from pathlib import Path

    from tunelab.core.record_data import DataManifest

    fixed = Path(__file__).parents[1] / "fixtures" / "plan-study" / "records" / "data"
    manifest = DataManifest.read(next(fixed.glob("*/manifest.json")))
    assert manifest.counts.final == {"train": 31, "validation": 5, "test": 4}
    assert (manifest.source.location, manifest.splits.settings.seed) == ("mail.jsonl", 0)
    assert (manifest.dedup.settings.threshold, manifest.dedup.images) == (0.8, False)
    raw = json.loads(manifest.path.read_text())
    raw["cleaning"]["rules"] = [{"rule": "drop_empty", "changed": "3"}]
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(StudyError, match=r"cleaning\.rules\[0\]: field 'changed' is '3'"):
        DataManifest.read(path)
    older = {"snapshot_id": "s", "files": {}}  # the pieces an older manifest lacks read empty
    assert DataManifest.of(path, older).duplicates.figures() == []


def test_an_inspection_reads_typed_and_a_damaged_token_is_located(tmp_path):
    from tunelab.core.record_inspect import Inspection

    token = {"id": 1, "text": "hi", "special": False, "loss": True}
    example = {"id": "a", "category": "ham", "num_tokens": 1, "tokens": [token]}
    raw = {
        "inspect_id": "inspect-1",
        "split": "train",
        "n": 1,
        "ok": True,
        "problems": [],
        "stats": {"n": 1, "p50": 1, "p95": 1, "max": 1, "share_truncated": 0.0},
        "answer_budget": {"max_new_tokens": 4, "n": 1, "over": 1, "longest": 9, "p95": 9},
        "collator": {"checked": False, "why": "encoder"},
        "examples": [example],
    }
    path = tmp_path / "inspect-1.json"
    ins = Inspection.of(path, raw)
    assert [t.text for t in ins.examples[0].tokens] == ["hi"] and ins.stats.p95 == 1
    assert "at least 9" in ins.answer_budget.warning and ins.collator_skipped == "encoder"
    assert ins.html_path == tmp_path / "inspect-1.html"
    example["tokens"][0]["loss"] = "yes"
    with pytest.raises(StudyError, match=r"examples\[0\]\.tokens\[0\]: field 'loss' is 'yes'"):
        Inspection.of(path, raw)
