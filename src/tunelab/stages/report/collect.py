"""Gather everything the dossier shows, from the records only (never from live objects).

Each part is optional: a study that has only reached the data stage still gets a dossier that
says which stages have no record yet. A record that is present but cannot be read is left out
of its section and listed in `unreadable` (its path and the located error), which the dossier's
Limitations section names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tunelab.core.errors import StudyError
from tunelab.core.evidence import all_hypotheses
from tunelab.core.ledger import RunRow
from tunelab.core.record_types import (
    Compare,
    Evaluation,
    ExportManifest,
    Hypothesis,
    Record,
    RunConfig,
    RunStatus,
    Sizing,
)
from tunelab.core.records import read_json
from tunelab.core.study import Study
from tunelab.stages.plan.stored import plans_in_order

R = TypeVar("R", bound=Record)


class _Reader:
    """Reads records for the dossier: an absent optional record is None; a damaged one is None
    too, and is listed in `unreadable` (path and the located error) for the dossier to name."""

    def __init__(self) -> None:
        self.unreadable: list[dict[str, str]] = []

    def damaged(self, path: Path, exc: StudyError) -> None:
        self.unreadable.append({"path": str(path), "error": exc.message})

    def json(self, path: Path) -> Any:
        if not path.exists():
            return None
        try:
            return read_json(path)
        except StudyError as exc:
            self.damaged(path, exc)
            return None

    def object(self, path: Path) -> dict[str, Any] | None:
        rec = self.json(path)
        if rec is not None and not isinstance(rec, dict):
            self.unreadable.append(
                {"path": str(path), "error": f"{path}: not a JSON object: the record is damaged"}
            )
            return None
        return rec

    def jsonl(self, path: Path) -> list[Any]:
        rows = []
        if not path.exists():
            return rows
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    error = f"{path}: line {number} is not valid JSON; the dossier leaves it out"
                    self.unreadable.append({"path": str(path), "error": error})
        return rows

    def records_in(self, folder: Path, pattern: str = "*.json") -> list[dict[str, Any]]:
        out = []
        if folder.is_dir():
            for p in sorted(folder.glob(pattern)):
                rec = self.object(p)
                if rec is not None:
                    rec.setdefault("_path", str(p))
                    out.append(rec)
        return out

    def typed_in(self, kind: type[R], folder: Path, pattern: str = "*.json") -> list[R]:
        """The records of `folder` matching `pattern` read as `kind`, by name; damaged ones
        left out and listed."""
        found = sorted(folder.glob(pattern)) if folder.is_dir() else []
        return [r for r in (self.typed(kind, p) for p in found) if r is not None]

    def typed(self, kind: type[R], path: Path) -> R | None:
        """The record at `path` read as `kind`; None when absent or damaged (listed)."""
        raw = self.json(path)
        if raw is None:
            return None
        try:
            return kind.of(path, raw)
        except StudyError as exc:
            self.damaged(path, exc)
            return None


@dataclass
class RunEvidence:
    """One run as the dossier reads it: its ledger row and the records in its folder."""

    row: RunRow
    config: RunConfig | None = None
    status: RunStatus | None = None
    env: dict[str, Any] | None = None
    audit: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, oldest first
    evaluations: dict[str, Evaluation] = field(default_factory=dict)  # by split
    verify: list[dict[str, Any]] = field(default_factory=list)
    # the ledger's, oldest first: statuses (interruptions, resumes), checks
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The name a user gave the run, else its id."""
        return self.row.name or self.row.id


def _collect_run(
    study: Study, row: RunRow, events: list[dict[str, Any]], read: _Reader
) -> RunEvidence:
    run_dir = study.runs_dir / row.id
    evaluations = {}
    for p in sorted(run_dir.glob("metrics-*.json")):
        ev = read.typed(Evaluation, p)
        if ev is not None:
            evaluations[p.stem.removeprefix("metrics-")] = ev
    return RunEvidence(
        row=row,
        config=read.typed(RunConfig, run_dir / "config.json"),
        status=read.typed(RunStatus, run_dir / "status.json"),
        env=read.object(run_dir / "env.json"),
        audit=read.object(run_dir / "audit.json"),
        steps=read.jsonl(run_dir / "metrics.jsonl"),
        evaluations=evaluations,
        verify=read.records_in(run_dir, "verify*.json"),
        events=events,
    )


def collect(study: Study) -> dict[str, Any]:
    rec = study.records
    read = _Reader()
    rows = study.list_runs()
    events: dict[str, list[dict[str, Any]]] = {}
    for e in study.ledger.events():
        events.setdefault(e["run_id"], []).append(e)
    runs = [_collect_run(study, r, events.get(r.id, []), read) for r in rows]
    data = []
    data_root = rec / "data"
    if data_root.is_dir():
        for d in sorted(data_root.iterdir()):
            m = read.object(d / "manifest.json")
            if m is not None:
                m["_duplicates"] = read.json(d / "duplicates.json")
                data.append(m)
    data.sort(key=lambda m: str(m.get("created_at", "")))
    exports = []
    if (rec / "exports").is_dir():
        for d in sorted((rec / "exports").iterdir()):
            m = read.typed(ExportManifest, d / "tunelab-manifest.json") or read.typed(
                ExportManifest, d / "manifest.json"
            )
            if m is not None:
                exports.append(m)
    return {
        "study": study.config.name,
        "root": str(study.root),
        "config": study.config.to_dict(),
        "hypotheses": [
            Hypothesis.of(rec / f"hypothesis-v{h.get('version')}.json", h)
            for h in all_hypotheses(rec)
        ],
        "data": data,
        "inspections": read.records_in(rec / "inspect"),
        "sizing": read.typed_in(Sizing, rec / "sizing"),
        "runs": runs,
        "compares": read.typed_in(Compare, rec / "compare"),
        "plans": plans_in_order(study, on_damaged=read.damaged),
        "exports": exports,
        "test_openings": study.ledger.test_openings(),
        "unreadable": read.unreadable,
    }
