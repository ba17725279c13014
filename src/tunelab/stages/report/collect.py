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
from tunelab.core.ledger import LedgerEvent, RunRow, SealedOpening
from tunelab.core.record_data import DataManifest
from tunelab.core.record_inspect import Inspection
from tunelab.core.record_plan import PlanSchedule
from tunelab.core.record_types import (
    Compare,
    Evaluation,
    ExportManifest,
    Hypothesis,
    Record,
    RunConfig,
    RunStatus,
    Sizing,
    Verify,
)
from tunelab.core.records import read_json
from tunelab.core.run_parts import RunEnv, TrainStep
from tunelab.core.study import Study
from tunelab.stages.plan.stored import plans_in_order

R = TypeVar("R", bound=Record)


class _Reader:
    """Reads records for the dossier: an absent optional record is None; a damaged one is None
    too, and is listed in `unreadable` (path and the located error) for the dossier to name."""

    def __init__(self) -> None:
        self.unreadable: list[Unreadable] = []

    def damaged(self, path: Path, exc: StudyError) -> None:
        self.unreadable.append(Unreadable(str(path), exc.message))

    def json(self, path: Path) -> Any:
        if not path.exists():
            return None
        try:
            return read_json(path)
        except StudyError as exc:
            self.damaged(path, exc)
            return None

    def jsonl(self, kind: type[R], path: Path) -> list[R]:
        """The lines of a JSONL record, each read as `kind`; a line that is not JSON or not
        its kind is left out and listed."""
        rows: list[R] = []
        if not path.exists():
            return rows
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(kind.of(path, json.loads(line), f"line {number}"))
                except json.JSONDecodeError:
                    error = f"{path}: line {number} is not valid JSON; the dossier leaves it out"
                    self.unreadable.append(Unreadable(str(path), error))
                except StudyError as exc:
                    self.damaged(path, exc)
        return rows

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


@dataclass(frozen=True)
class Unreadable:
    """A record the dossier could not read: its path and the located error."""

    path: str
    error: str


@dataclass
class RunEvidence:
    """One run as the dossier reads it: its ledger row and the records in its folder."""

    row: RunRow
    config: RunConfig | None = None
    status: RunStatus | None = None
    env: RunEnv | None = None
    steps: list[TrainStep] = field(default_factory=list)  # metrics.jsonl, oldest first
    evaluations: dict[str, Evaluation] = field(default_factory=dict)  # by split
    verify: list[Verify] = field(default_factory=list)
    # the ledger's, oldest first: statuses (interruptions, resumes), checks
    events: list[LedgerEvent] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The name a user gave the run, else its id."""
        return self.row.name or self.row.id


@dataclass
class Collected:
    """Everything the dossier shows, read from the records (`collect`)."""

    study: str = ""
    root: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the study config, validated
    hypotheses: list[Hypothesis] = field(default_factory=list)
    data: list[DataManifest] = field(default_factory=list)  # oldest first
    inspections: list[Inspection] = field(default_factory=list)
    sizing: list[Sizing] = field(default_factory=list)
    runs: list[RunEvidence] = field(default_factory=list)
    compares: list[Compare] = field(default_factory=list)
    plans: list[PlanSchedule] = field(default_factory=list)  # oldest first
    exports: list[ExportManifest] = field(default_factory=list)
    test_openings: list[SealedOpening] = field(default_factory=list)
    unreadable: list[Unreadable] = field(default_factory=list)


def _collect_run(
    study: Study, row: RunRow, events: list[LedgerEvent], read: _Reader
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
        env=read.typed(RunEnv, run_dir / "env.json"),
        steps=read.jsonl(TrainStep, run_dir / "metrics.jsonl"),
        evaluations=evaluations,
        verify=read.typed_in(Verify, run_dir, "verify*.json"),
        events=events,
    )


def _data_snapshots(root: Path, read: _Reader) -> list[DataManifest]:
    """The manifest of every snapshot, oldest first."""
    found = sorted(root.iterdir()) if root.is_dir() else []
    manifests = [m for m in (read.typed(DataManifest, d / "manifest.json") for d in found) if m]
    return sorted(manifests, key=lambda m: str(m.created_at or ""))


def _plans(study: Study, read: _Reader) -> list[PlanSchedule]:
    """Every plan, oldest first (stages.plan.stored.plans_in_order), read typed."""
    out = []
    for raw in plans_in_order(study, on_damaged=read.damaged):
        path = Path(raw.pop("_path"))
        try:
            out.append(PlanSchedule.of(path, raw))
        except StudyError as exc:
            read.damaged(path, exc)
    return out


def _exports(root: Path, read: _Reader) -> list[ExportManifest]:
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        m = read.typed(ExportManifest, d / "tunelab-manifest.json") or read.typed(
            ExportManifest, d / "manifest.json"
        )
        if m is not None:
            out.append(m)
    return out


def collect(study: Study) -> Collected:
    rec = study.records
    read = _Reader()
    events: dict[str | None, list[LedgerEvent]] = {}
    for e in study.ledger.events():
        events.setdefault(e.run_id, []).append(e)
    runs = [_collect_run(study, r, events.get(r.id, []), read) for r in study.list_runs()]
    openings = study.ledger.test_openings()
    return Collected(
        study=study.config.name,
        root=str(study.root),
        config=study.config.to_dict(),
        hypotheses=all_hypotheses(rec),
        data=_data_snapshots(rec / "data", read),
        inspections=read.typed_in(Inspection, rec / "inspect"),
        sizing=read.typed_in(Sizing, rec / "sizing"),
        runs=runs,
        compares=read.typed_in(Compare, rec / "compare"),
        plans=_plans(study, read),
        exports=_exports(rec / "exports", read),
        test_openings=openings,
        unreadable=read.unreadable,
    )
