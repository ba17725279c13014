"""What a user reads: terminal output captured at 80 columns, without a TTY."""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_cli


@pytest.fixture(autouse=True)
def eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("FORCE_COLOR", raising=False)


def assert_fits(text: str) -> None:
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, "lines wider than 80 columns:\n" + "\n".join(wide)


def test_help_lists_commands_in_protocol_order_one_line_each(capsys):
    from tunelab.cli._help import PROTOCOL

    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert_fits(out)
    assert "<bool>" not in out
    assert "Other" not in out  # every command has its stage
    listed = re.findall(r"^│ ([a-z][a-z-]+)\s{2,}\S", out, flags=re.M)
    expected = [name for _, items in PROTOCOL for name, _ in items]
    assert listed == expected
    for panel, _ in PROTOCOL:
        assert f"─ {panel} ─" in out
    # one line per command: no continuation line inside a command panel
    assert not re.search(r"^│ {10,}\S", out, flags=re.M)


def test_command_help_shows_no_type_for_flags(capsys):
    code, out, _ = run_cli(capsys, "compare", "--help")
    assert code == 0
    assert_fits(out)
    assert "<bool>" not in out
    assert re.search(r"--json\s+Print the result as JSON", out)


def _compare_output(tmp_path, capsys) -> tuple[str, list]:
    from test_compare import _populate, _study

    study = _study(tmp_path)
    runs = _populate(study)
    code, out, err = run_cli(capsys, "compare", "-s", study.root)
    assert code == 0, err
    return out, runs


def test_compare_shows_names_full_ids_and_both_verdicts(tmp_path, capsys):
    out, (base, good, messy, failed, *_) = _compare_output(tmp_path, capsys)
    assert_fits(out)
    assert "…" not in out  # no id or cell cut
    summary = out.split("\n\n")[0]
    for run in (good, messy, failed):
        assert run.id in summary
    assert re.search(r"│ r16 +│ \+0\.4500", summary)  # the name the user gave, above its id
    assert re.search(rf"│ {good.id} │ \[\+0\.3\d+, \+0\.6\d+\] ", summary)
    # the interval's verdict beside the threshold's: a zero delta spans 0 and does not meet min
    rows = {line.split("│")[1].strip(): line for line in summary.splitlines() if "│" in line}
    assert rows["r16"].split("│")[3:5] == [" above 0 ", " yes   "]
    assert rows[messy.id].split("│")[3:5] == [" spans 0 ", " no    "]
    assert "oom: failed: CUDA out of memory" in summary


def test_compare_says_no_difference_for_an_empty_config_diff(tmp_path, capsys):
    from test_compare import _study
    from tunelab.study import Study

    study = _study(tmp_path)
    _populate_same_config(study, Study)
    code, out, err = run_cli(capsys, "compare", "-s", study.root)
    assert code == 0, err
    assert re.search(r"config diff against baseline-\S+: no difference", out)
    assert "┃ group" not in out


def _populate_same_config(study, Study) -> None:
    from test_compare import BASE_P, GOLDS, GOOD_P, _record

    base = study.create_run("baseline", data_snapshot="snap1", config=study.config)
    _record(study, base, GOLDS, BASE_P)
    base.set_status("completed")
    same = study.create_run("train", name="same", data_snapshot="snap1", config=study.config)
    _record(study, same, GOLDS, GOOD_P)
    same.set_status("completed")


def test_model_card_prints_the_interval_verdict_beside_the_threshold():
    from tunelab.export.card import primary_verdict

    spans = {"metric": "macro_f1", "delta": 0.03, "ci_low": -0.01, "ci_high": 0.07}
    spans.update(min_improvement=0.02, meets_min_improvement=True, significant=False)
    text = primary_verdict(spans)
    assert "95% interval spans 0 (significant: no)" in text
    assert "minimum improvement 0.0200: met" in text
