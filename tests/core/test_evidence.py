"""core/evidence: one rule for the latest record of each kind, on a real study folder."""

from __future__ import annotations

import json
import time

import pytest

from helpers import run_cli
from tunelab.core.errors import StudyError
from tunelab.core.evidence import find_evaluation, latest, latest_baseline, latest_numbered
from tunelab.core.study import Study


@pytest.fixture
def study(tmp_path, capsys) -> Study:
    code, _, err = run_cli(capsys, "init", tmp_path / "s", "--task", "classification")
    assert code == 0, err
    return Study.open(tmp_path / "s")


def _run(study: Study, kind: str, status: str = "completed", parent: str | None = None, **files):
    run = study.create_run(kind, parent=parent)
    for name, obj in files.items():
        (run.dir / name.replace("_", "-").replace("-json", ".json")).write_text(json.dumps(obj))
    run.set_status(status)
    time.sleep(0.002)  # created_at has millisecond resolution: keep the order unambiguous
    return run


def test_latest_run_is_the_newest_completed_one_with_its_record(study):
    first = _run(study, "smoke", smoke_json={"step_s": 1.0})
    second = _run(study, "smoke", smoke_json={"step_s": 2.0})
    _run(study, "smoke", status="failed", smoke_json={"step_s": 3.0})  # not finished
    _run(study, "smoke")  # completed, but no smoke.json: passed over
    found = latest(study, "smoke", "smoke.json")
    assert found.run_id == second.id != first.id and found.read() == {"step_s": 2.0}
    assert latest(study, "train", "metrics-validation.json") is None


def test_a_damaged_latest_record_raises_instead_of_falling_back(study):
    _run(study, "smoke", smoke_json={"step_s": 1.0})
    broken = _run(study, "smoke", smoke_json={"step_s": 2.0})
    (broken.dir / "smoke.json").write_text('{"step_s": ')
    with pytest.raises(StudyError, match=r"smoke\.json: not valid JSON \(line 1\)"):
        latest(study, "smoke", "smoke.json").read()


def test_one_baseline_rule_and_evaluations_of_a_run(study):
    old = _run(study, "baseline", metrics_validation_json={"n": 1})
    new = _run(study, "baseline", metrics_validation_json={"n": 2})
    # only the old baseline was evaluated on the test split (by an eval run of it)
    _run(study, "eval", parent=old.id, metrics_test_json={"n": 3})
    row, evaluation = latest_baseline(study, "validation")
    assert row.id == new.id and evaluation["record"] == {"n": 2}
    row, evaluation = latest_baseline(study, "test")
    assert row.id == old.id and evaluation["record"] == {"n": 3}
    # a newer eval of the run wins over its own metrics
    again = _run(study, "eval", parent=new.id, metrics_validation_json={"n": 4})
    assert find_evaluation(study, new.id)["eval_run"] == again.id
    assert find_evaluation(study, old.id)["eval_run"] == old.id
    assert find_evaluation(study, new.id, "test") is None


def test_numbered_records_order_by_number_not_by_name(tmp_path):
    for n in (1, 2, 10):
        (tmp_path / f"verify-{n}.json").write_text("{}")
    (tmp_path / "verify-x.json").write_text("{}")
    assert latest_numbered(tmp_path, "verify-").name == "verify-10.json"
    assert latest_numbered(tmp_path / "absent", "verify-") is None


def test_latest_plan_by_creation_time_not_by_name(study):
    plans = study.records / "plans"
    plans.mkdir()
    for name, ns in (("plan-20260102-030405-ffffff", 1), ("plan-20260102-030405-000000", 2)):
        (plans / f"{name}.json").write_text(json.dumps({"id": name, "created_ns": ns}))
    assert latest(study, "plan").read()["id"] == "plan-20260102-030405-000000"
    assert latest(study, "sizing") is None
