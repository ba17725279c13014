"""What `tunelab plan` and `tunelab plan --review` print, as a person reads it: captured at 80
columns without a terminal. The review's summary keeps the sign of its table, a phase far off
either way is remarked on whatever its margin, a plan's title names the device its figures are
for, and a figure in seconds per example says what its sign means."""

from __future__ import annotations

import json
import re

import pytest

from helpers import run_cli
from helpers.plan import _finished_run, _sizing_record, _study
from tunelab.core.records import write_json_atomic


@pytest.fixture(autouse=True)
def narrow(monkeypatch):
    from tunelab.cli import common

    monkeypatch.setattr(common.console, "width", 80)


def _lines(out: str) -> list[str]:
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    return lines


def _planned(tmp_path, model_dir):
    from tunelab.stages.plan import stage as plan_stage

    study = _study(tmp_path / "s", model_dir)
    _sizing_record(study)
    _finished_run(study, "smoke", 30.0)
    _finished_run(study, "baseline", 12.0)
    plan, _, _ = plan_stage.run(study, days=3)
    return study, plan


def _row(out: str, phase: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"│ {phase}"))


def test_an_overestimate_of_300_percent_is_far_off_not_just_within_margin(
    tmp_path, tiny_llama_dir, capsys
):
    study, plan = _planned(tmp_path, tiny_llama_dir)
    _finished_run(study, "train", plan["variant"]["total_s"] / 4)  # planned 4 x what it took
    code, out, err = run_cli(capsys, "plan", "-s", study.root, "--review")
    assert code == 0, err
    _lines(out)
    assert re.search(r"\+300\.\d%", _row(out, "experiments"))
    assert re.search(r"largest phase error: experiments \+300\.\d%", out)
    assert re.search(
        r"far off: experiments: planned .*\(\+300\.\d %\): the plan is far\s+longer", out
    )
    # the margins held (3 x too long fits any margin), and that is not all the review says
    assert "the plan's margins absorbed every measured phase" not in _lines(out)
    code, out, _ = run_cli(capsys, "plan", "-s", study.root, "--review", "--json")
    review = json.loads(out[out.index("{") :])
    rows = {r["phase"]: r for r in review["rows"]}
    assert rows["experiments"]["within_margin"] and rows["experiments"]["far_off"]
    assert review["largest_error"]["phase"] == "experiments"
    assert review["largest_error"]["error_pct"] == pytest.approx(300.0, abs=0.2)


def test_the_summary_keeps_the_sign_of_the_table(tmp_path, tiny_llama_dir, capsys):
    """An underestimate: the table, the summary and the margin sentence all say the plan was
    short; the largest error is the negative one even beside a smaller positive one."""
    study, plan = _planned(tmp_path, tiny_llama_dir)
    _finished_run(study, "train", plan["variant"]["total_s"] * 3)  # took 3 x the plan
    study.ledger.add_event(None, "export", {"export_id": "export-x", "seconds": 2.0})
    code, out, err = run_cli(capsys, "plan", "-s", study.root, "--review")
    assert code == 0, err
    _lines(out)
    assert re.search(r"-66\.\d%", _row(out, "experiments"))
    assert re.search(r"largest phase error: experiments -66\.\d%", out)
    assert not re.search(r"\+66\.\d", out)
    assert re.search(r"the plan is far\s+shorter than the runs", out)
    assert re.search(r"experiments took 200\.\d%\s+more\s+than\s+planned\s+\(margin 15%\)", out)


def test_a_plan_names_the_device_its_figures_are_for(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    """Four plans of one second whose ids sort against their order: the dossier and the review
    still take the last one made."""
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from tunelab.stages.plan import stage

    class OneSecond(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    suffixes = iter(["ffffff", "eeeeee", "dddddd", "000000"])
    monkeypatch.setattr(stage, "datetime", OneSecond)
    monkeypatch.setattr(stage, "secrets", SimpleNamespace(token_hex=lambda n: next(suffixes)))
    study, _ = _planned(tmp_path, tiny_llama_dir)  # budget.gpu says "1x H100 80GB"
    code, out, err = run_cli(capsys, "plan", "-s", study.root, "--days", "3")
    assert code == 0, err
    title = _lines(out)[0]
    assert title.startswith("3-day plan on this machine's CPU (") and "H100" not in title
    code, out, err = run_cli(capsys, "plan", "-s", study.root, "--speedup", "20")
    assert code == 0, err
    assert out.splitlines()[0].startswith("7-day plan on 1x H100 80GB (20 x this machine's")
    code, out, _ = run_cli(capsys, "plan", "-s", study.root, "--gpu", "L4")
    assert out.splitlines()[0].startswith("7-day plan on 1x NVIDIA L4 24GB (projected)")
    ids = sorted(p.stem for p in (study.records / "plans").glob("plan-*.json"))
    assert ids == [f"plan-20260102-030405-{s}" for s in ("000000", "dddddd", "eeeeee", "ffffff")]
    from tunelab.core.evidence import latest
    from tunelab.stages.report import stage as report_stage

    assert latest(study, "plan").read()["id"] == "plan-20260102-030405-000000"
    md = report_stage.run(study)["markdown"].read_text()
    section = md[md.index("## Rental plan") :]
    assert "days on 1x NVIDIA L4 24GB (projected) at" in section


def test_a_negative_seconds_per_example_says_what_it_means(tmp_path, tiny_llama_dir, capsys):
    """The base model generated to its budget, the answers are shorter: a variant's evaluation
    is priced less per example, and the plan says why in words."""
    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    base = _finished_run(study, "baseline", 12.0)
    gen = {
        "steps": 64,
        "answer_steps": 21,
        "s_per_step": 0.1,
        "batches": [
            {"n": 4, "steps": 64, "answer_steps": 21, "prefill_s": 1.0, "decode_s": 6.3,
             "prompt_tokens": 40},
        ],
    }  # fmt: skip
    write_json_atomic(
        study.runs_dir / base / "metrics-validation.json",
        {
            "split": "validation",
            "metrics": {},
            "seconds": 7.3,
            "n": 4,
            "load_s": 3.0,
            "generation": gen,
        },  # fmt: skip
    )
    code, out, err = run_cli(capsys, "plan", "-s", study.root)
    assert code == 0, err
    text = " ".join(line.strip() for line in _lines(out))
    assert "answer_length_s_per_example: -" in text
    assert "s an example: the answers are shorter than what the baseline generated" in text
