"""A damaged ledger found on opening, moved aside and rebuilt from the records.

The ledger is an index: every run's folder holds config.json, env.json and status.json, and an
evaluation of the sealed test split names itself in its config.json. A ledger that SQLite cannot
read (truncated, overwritten, a torn copy) is renamed to `ledger.sqlite.damaged-<time>` beside
the new one, so nothing is lost, and the runs, their last statuses and the test openings are
indexed again. Events the records do not hold (heartbeats, intermediate statuses) are not
invented.
"""

from __future__ import annotations

import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.core.hashing import sha256_json
from tunelab.core.records import read_json

REQUIRED_TABLES = ("runs", "events", "test_openings", "schema_migrations")


def ledger_damage(path: Path) -> str | None:
    """What is wrong with the ledger at `path` (None when it is sound or absent)."""
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(path, timeout=30.0)
        try:
            found = db.execute("PRAGMA quick_check").fetchall()
            if found != [("ok",)]:
                return "; ".join(str(r[0]) for r in found[:3])
            for table in REQUIRED_TABLES:
                db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return None  # another process writes: busy, not damaged
        return str(exc)
    except sqlite3.DatabaseError as exc:
        return str(exc)
    return None


def move_aside(path: Path) -> Path:
    """Rename the damaged ledger (and its -wal / -shm files) beside it; returns its new name."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    os.replace(path, aside)
    for suffix in ("-wal", "-shm"):
        extra = path.with_name(path.name + suffix)
        if extra.exists():
            os.replace(extra, aside.with_name(aside.name + suffix))
    return aside


def _created_at(run_id: str, run_dir: Path) -> str:
    """The creation time in the run's id (kind-YYYYmmdd-HHMMSS-hex), else its folder's."""
    parts = run_id.split("-")
    try:
        when = datetime.strptime("-".join(parts[-3:-1]), "%Y%m%d-%H%M%S").replace(tzinfo=UTC)
    except ValueError:
        when = datetime.fromtimestamp(run_dir.stat().st_mtime, UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def run_rows(runs_dir: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(ledger row, config.json) of every run folder with a readable config.json."""
    out = []
    for run_dir in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        if not (run_dir / "config.json").is_file():
            continue
        cfg = read_json(run_dir / "config.json")
        status = read_json(run_dir / "status.json") if (run_dir / "status.json").is_file() else {}
        env = read_json(run_dir / "env.json") if (run_dir / "env.json").is_file() else None
        state = status.get("status", "interrupted")
        row = {
            "id": run_dir.name,
            "kind": cfg.get("kind"),
            "name": cfg.get("name"),
            "parent": cfg.get("parent"),
            "status": state,
            "reason": status.get("reason"),
            "created_at": _created_at(run_dir.name, run_dir),
            "finished_at": None if state == "running" else status.get("at"),
            "heartbeat_at": status.get("at"),
            "config_sha": cfg.get("config_sha256"),
            "data_snapshot": cfg.get("data_snapshot"),
            "hypothesis_version": cfg.get("hypothesis_version"),
            "hypothesis_sha": cfg.get("hypothesis_sha256"),
            "env_sha": sha256_json(env) if env is not None else None,
            "why": cfg.get("why"),
        }
        out.append((row, cfg))
    return out


def refill(db: sqlite3.Connection, runs_dir: Path) -> int:
    """Index every run of `runs_dir` into the empty ledger `db`; returns how many."""
    rows = run_rows(runs_dir)
    for row, cfg in sorted(rows, key=lambda rc: (rc[0]["created_at"], rc[0]["id"])):
        cols = list(row)
        db.execute(
            f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
            [row[c] for c in cols],
        )
        db.execute(
            "INSERT INTO events (run_id, at, kind, detail) VALUES (?, ?, ?, ?)",
            (row["id"], row["created_at"], "created", "rebuilt from records"),
        )
        db.execute(
            "INSERT INTO events (run_id, at, kind, detail) VALUES (?, ?, ?, ?)",
            (row["id"], row["heartbeat_at"] or row["created_at"], f"status:{row['status']}",
             row["reason"]),
        )  # fmt: skip
        if cfg.get("split") == "test":
            db.execute(
                "INSERT INTO test_openings (at, who, why, snapshot, run_id) VALUES (?, ?, ?, ?, ?)",
                (row["created_at"], "tunelab eval --final", row["why"] or "final",
                 row["data_snapshot"] or "", row["id"]),
            )  # fmt: skip
    return len(rows)
