"""Pinned behaviour: the plan and the dossier built from fixed records, against stored copies.

tests/fixtures/plan-study/ holds the records of a real study on the tiny Llama (made once by
tests/fixtures/make_plan_study.py: register, data, baseline, smoke, size, plan, two training
runs, their evaluations, compare, verify, export). From those records this test builds
`tunelab plan` (its JSON and its text at 80 columns), `tunelab plan --review` and `tunelab
report` (dossier.md and dossier.html), and compares each with tests/fixtures/golden/.

A diff means the planner's or the dossier's behaviour changed. When the change is intended,
regenerate the golden files and review their diff before committing:

    TUNELAB_UPDATE_GOLDEN=1 pytest tests/stages/report/test_pinned_plan_report.py

What changes by itself is normalised: the plan's id and creation time, the config's sha256 (it
covers the defaults of every config section), the study's path, the dossier's build time, the embedded images, floats beyond 10 significant digits. The one figure
measured at planning time (the sha256 rate of this machine) is fixed to 400 MiB/s.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from helpers import run_cli

GOLDEN = Path(__file__).parents[2] / "fixtures" / "golden"
UPDATE = os.environ.get("TUNELAB_UPDATE_GOLDEN") == "1"
PLAN_ID = re.compile(r"plan-\d{8}-\d{6}-[0-9a-f]{6}")


def _round(value):
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def _normalise(text: str, root: Path) -> str:
    text = text.replace(str(root), "<study>")
    text = PLAN_ID.sub("plan-<id>", text)
    text = re.sub(r"Built \S+ from", "Built <time> from", text)
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:image/png;base64,<png>", text)


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden {path.name}: run with TUNELAB_UPDATE_GOLDEN=1"
    expected = path.read_text()
    assert text == expected, (
        f"{name} differs from tests/fixtures/golden/{name}: the behaviour changed; if that is "
        "intended, regenerate with TUNELAB_UPDATE_GOLDEN=1 and review the diff"
    )


def test_plan_from_fixed_records(pinned, capsys):
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--days", "3", "--json")
    assert code == 0, err
    record = json.loads(out[out.index("{") :])
    # the config's sha covers every config field's default: a new field elsewhere changes it
    for key in ("id", "created_at", "created_ns", "config_sha256"):
        assert record.pop(key)
    record["review"]["plan"] = "plan-<id>"
    text = json.dumps(_round(record), indent=1, sort_keys=True) + "\n"
    _check("plan.json", _normalise(text, pinned))
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--days", "7")
    assert code == 0, err
    # the record's and the chart's paths end the output (wrapped at 80 columns): not pinned
    _check("plan.txt", _normalise(out[: out.index("record: ")], pinned))


def test_plan_review_from_fixed_records(pinned, capsys):
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--review")
    assert code == 0, err
    _check("review.txt", _normalise(out, pinned))
    code, out, err = run_cli(capsys, "plan", "-s", pinned, "--review", "--json")
    assert code == 0, err
    review = json.loads(out[out.index("{") :])
    _check("review.json", json.dumps(_round(review), indent=1, sort_keys=True) + "\n")


def test_dossier_from_fixed_records(pinned, capsys):
    code, _, err = run_cli(capsys, "report", "-s", pinned)
    assert code == 0, err
    _check("dossier.md", _normalise((pinned / "report" / "dossier.md").read_text(), pinned))
    _check("dossier.html", _normalise((pinned / "report" / "dossier.html").read_text(), pinned))


def test_the_dossier_names_each_record_it_could_not_read(pinned, capsys):
    """A damaged record is not skipped in silence: the dossier is still built, and its
    Limitations section names the file and the located error."""
    runs = pinned / "records" / "runs"
    metrics = next(runs.glob("eval-*/metrics-validation.json"))
    metrics.write_text('{"split": "validation", ')
    plan = next((pinned / "records" / "plans").glob("plan-*.json"))
    plan.write_text("[")
    manifest = next((pinned / "records" / "data").glob("*/manifest.json"))
    raw = json.loads(manifest.read_text())
    raw["counts"]["rows_read"] = "forty"
    manifest.write_text(json.dumps(raw))
    code, _, err = run_cli(capsys, "report", "-s", pinned)
    assert code == 0, err
    md = (pinned / "report" / "dossier.md").read_text()
    limits = md[md.index("## Limitations") :]
    assert "3 record(s) could not be read" in limits
    assert f"{metrics}: not valid JSON (line 1): the record is damaged" in limits
    assert f"{plan}: not valid JSON (line 1)" in limits
    assert f"{manifest}: counts: field 'rows_read' is 'forty', not int" in limits
    assert "No data snapshot recorded." in md


@pytest.mark.parametrize(
    ("record", "text", "error"),
    [
        ("runs/smoke-*/smoke.json", '{"passed": true, ', "not valid JSON (line 1)"),
        ("runs/smoke-*/smoke.json", '{"checks": []}', "field 'passed' is missing"),
        ("sizing/size-*.json", '{"id": 3}', "field 'id' is 3, not a string"),
    ],
)
def test_a_damaged_record_stops_the_plan_naming_it(pinned, capsys, record, text, error):
    """The planner reads its evidence typed: a damaged record is refused with its path and what
    is wrong, exit 2, and no plan is written."""
    path = next((pinned / "records").glob(record))
    path.write_text(text)
    before = sorted((pinned / "records" / "plans").iterdir())
    code, _, err = run_cli(capsys, "plan", "-s", pinned, "--days", "3")
    assert code == 2
    assert f"{path}: {error}" in " ".join(err.split())
    assert sorted((pinned / "records" / "plans").iterdir()) == before
