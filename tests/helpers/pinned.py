"""The fixed plan study (tests/fixtures/plan-study) copied into a temp folder, as a fixture."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parents[1] / "fixtures" / "plan-study"


PLACEHOLDER = "@STUDY@"


HASH_RATE = 400.0 * 2**20


@pytest.fixture
def pinned(tmp_path, monkeypatch) -> Path:
    """A copy of the fixed study with its own path put back and its ledger loaded."""
    from tunelab.cli import common

    root = tmp_path / "study"
    shutil.copytree(FIXTURE, root)
    for p in root.rglob("*"):
        if p.is_file() and p.suffix in {".json", ".jsonl", ".yaml", ".md", ".sql"}:
            text = p.read_text()
            if PLACEHOLDER in text:
                p.write_text(text.replace(PLACEHOLDER, str(root)))
    dump = root / "records" / "ledger.sql"
    db = sqlite3.connect(root / "records" / "ledger.sqlite")
    db.executescript(dump.read_text())
    db.close()
    dump.unlink()
    monkeypatch.setattr("tunelab.lib.probes.hash_rate", lambda: HASH_RATE)
    monkeypatch.setattr(common.console, "width", 80)
    return root
