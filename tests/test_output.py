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
