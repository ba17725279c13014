"""SQLite index of runs, their statuses, events and test-split openings.

The ledger is an index: the records on disk are the evidence, the ledger makes them quick to list.
It uses WAL and a busy timeout so that two `tunelab train` processes can write at once, and
numbered migrations so that an older study opens with a newer tunelab.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.core.ledger_rebuild import ledger_damage, move_aside, refill

MIGRATIONS: list[str] = [
    # 1: runs, events, test openings
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        name TEXT,
        parent TEXT,
        status TEXT NOT NULL,
        reason TEXT,
        created_at TEXT NOT NULL,
        finished_at TEXT,
        heartbeat_at TEXT,
        pid INTEGER,
        config_sha TEXT,
        data_snapshot TEXT,
        hypothesis_version INTEGER,
        hypothesis_sha TEXT,
        env_sha TEXT,
        why TEXT
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT,
        at TEXT NOT NULL,
        kind TEXT NOT NULL,
        detail TEXT
    );
    CREATE TABLE test_openings (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at TEXT NOT NULL,
        who TEXT NOT NULL,
        why TEXT NOT NULL,
        snapshot TEXT NOT NULL,
        run_id TEXT
    );
    """,
]

RUN_COLUMNS = (
    "id",
    "kind",
    "name",
    "parent",
    "status",
    "reason",
    "created_at",
    "finished_at",
    "heartbeat_at",
    "pid",
    "config_sha",
    "data_snapshot",
    "hypothesis_version",
    "hypothesis_sha",
    "env_sha",
    "why",
)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class RunRow:
    """One run as the ledger indexes it (the columns of `runs`, in order)."""

    id: str
    kind: str
    name: str | None = None
    parent: str | None = None
    status: str = "running"
    reason: str | None = None
    created_at: str = ""
    finished_at: str | None = None
    heartbeat_at: str | None = None
    pid: int | None = None
    config_sha: str | None = None
    data_snapshot: str | None = None
    hypothesis_version: int | None = None
    hypothesis_sha: str | None = None
    env_sha: str | None = None
    why: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LedgerEvent:
    """One event the ledger logged (a status change, a check, a snapshot), oldest id first."""

    kind: str
    at: str
    detail: Any = None  # text, or the JSON text of an object
    run_id: str | None = None
    id: int | None = None

    def detail_object(self) -> dict[str, Any]:
        """The detail as the JSON object it was logged as ({} for text or none)."""
        try:
            value = json.loads(self.detail) if isinstance(self.detail, str) else None
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class SealedOpening:
    """One opening of the sealed test split, as the ledger logged it."""

    at: str
    who: str
    why: str
    run_id: str | None = None
    snapshot: str | None = None
    id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("id", "at", "who", "why", "snapshot", "run_id")}


class LedgerRebuilt(UserWarning):
    """The ledger was damaged: moved aside and rebuilt from the records."""


@contextmanager
def _opening_lock(folder: Path) -> Iterator[None]:
    """One process at a time checks, moves aside or creates the ledger: a ledger another process
    is still creating has no tables yet and would otherwise be taken for a damaged one."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rebuilt: str | None = None  # what was wrong, when this opening rebuilt the ledger
        with _opening_lock(path.parent):
            damage = ledger_damage(path)
            aside = move_aside(path) if damage else None
            with self._connect() as db:
                self._migrate(db)
                if aside is not None:
                    n = refill(db, path.parent / "runs")
                    self.rebuilt = (
                        f"{path} was damaged ({damage}); rebuilt from {path.parent}/runs "
                        f"({n} run(s)); the damaged file is kept as {aside.name}"
                    )
        if self.rebuilt:
            warnings.warn(self.rebuilt, LedgerRebuilt, stacklevel=2)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA foreign_keys=ON")
            yield db
        finally:
            db.close()

    def _migrate(self, db: sqlite3.Connection) -> None:
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, at TEXT)"
        )
        for attempt in range(50):
            try:
                db.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError:
                time.sleep(0.1 * (attempt + 1))
        try:
            done = {r[0] for r in db.execute("SELECT version FROM schema_migrations")}
            for version, sql in enumerate(MIGRATIONS, start=1):
                if version in done:
                    continue
                for statement in sql.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, utc_now()))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------ runs

    def add_run(self, **fields: Any) -> None:
        fields.setdefault("created_at", utc_now())
        fields.setdefault("heartbeat_at", fields["created_at"])
        cols = [c for c in RUN_COLUMNS if c in fields]
        with self._connect() as db:
            db.execute(
                f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                [fields[c] for c in cols],
            )
            db.execute(
                "INSERT INTO events (run_id, at, kind, detail) VALUES (?, ?, ?, ?)",
                (fields["id"], fields["created_at"], "created", fields.get("status")),
            )

    def update_run(self, run_id: str, **fields: Any) -> None:
        bad = set(fields) - set(RUN_COLUMNS)
        assert not bad, f"unknown run columns {bad}"
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*fields.values(), run_id])

    def heartbeat(self, run_id: str) -> None:
        self.update_run(run_id, heartbeat_at=utc_now())

    def get_run(self, run_id: str) -> RunRow | None:
        with self._connect() as db:
            row = db.execute(
                f"SELECT {', '.join(RUN_COLUMNS)} FROM runs WHERE id = ?", (run_id,)
            ).fetchone()
        return RunRow(*row) if row else None

    def list_runs(self, kind: str | None = None) -> list[RunRow]:
        sql = f"SELECT {', '.join(RUN_COLUMNS)} FROM runs"
        args: tuple[Any, ...] = ()
        if kind:
            sql += " WHERE kind = ?"
            args = (kind,)
        with self._connect() as db:
            rows = db.execute(sql + " ORDER BY created_at, id", args).fetchall()
        return [RunRow(*r) for r in rows]

    # ------------------------------------------------------------ events and openings

    def add_event(self, run_id: str | None, kind: str, detail: Any = None) -> None:
        text = (
            detail if isinstance(detail, str) or detail is None else json.dumps(detail, default=str)
        )
        with self._connect() as db:
            db.execute(
                "INSERT INTO events (run_id, at, kind, detail) VALUES (?, ?, ?, ?)",
                (run_id, utc_now(), kind, text),
            )

    def events(self, run_id: str | None = None) -> list[LedgerEvent]:
        sql = "SELECT id, run_id, at, kind, detail FROM events"
        args: tuple[Any, ...] = ()
        if run_id:
            sql += " WHERE run_id = ?"
            args = (run_id,)
        with self._connect() as db:
            rows = db.execute(sql + " ORDER BY id", args).fetchall()
        return [LedgerEvent(kind, at, detail, rid, i) for i, rid, at, kind, detail in rows]

    def log_test_opening(self, who: str, why: str, snapshot: str, run_id: str | None) -> int:
        """Record an opening of the sealed test split; returns how many openings there now are."""
        with self._connect() as db:
            db.execute(
                "INSERT INTO test_openings (at, who, why, snapshot, run_id) VALUES (?, ?, ?, ?, ?)",
                (utc_now(), who, why, snapshot, run_id),
            )
            return db.execute("SELECT COUNT(*) FROM test_openings").fetchone()[0]

    def test_openings(self) -> list[SealedOpening]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT id, at, who, why, snapshot, run_id FROM test_openings ORDER BY id"
            ).fetchall()
        return [SealedOpening(at, who, why, rid, snap, i) for i, at, who, why, snap, rid in rows]
