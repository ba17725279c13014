"""What every section builder reads: the collected records and the lookups built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tunelab.core.record_types import Evaluation, Record
from tunelab.core.study import Study
from tunelab.stages.report.collect import Collected, RunEvidence


def short(s: Any, n: int = 12) -> str:
    return str(s)[:n] if s else "-"


def _instant(stamp: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass
class Dossier:
    """The study, its collected records (`tunelab.stages.report.collect.collect`) and the plot folder."""

    study: Study
    data: Collected
    plot_dir: Path
    runs: list[RunEvidence] = field(init=False)

    def __post_init__(self) -> None:
        self.runs = self.data.runs

    @cached_property
    def runs_by_id(self) -> dict[str, RunEvidence]:
        return {r.row.id: r for r in self.runs}

    @cached_property
    def evaluated(self) -> dict[str, Evaluation]:
        """run id -> its validation evaluation record; eval runs are attributed to their parent.
        Smoke runs are left out: they evaluate a handful of examples to test the pipeline."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.runs:
            ev = r.evaluations.get("validation")
            if ev is None or r.row.kind == "smoke":
                continue
            target = r.row.parent if r.row.kind == "eval" and r.row.parent else r.row.id
            out[target] = ev
        return out

    @cached_property
    def order(self) -> list[str]:
        """The evaluated runs, baselines first."""
        baselines = [
            r.row.id for r in self.runs if r.row.kind == "baseline" and r.row.id in self.evaluated
        ]
        return baselines + [i for i in self.evaluated if i not in set(baselines)]

    def label(self, run_id: str) -> str:
        """The name a user gave the run, else its id."""
        r = self.runs_by_id.get(run_id)
        return run_id if r is None else r.label

    @cached_property
    def current_version(self) -> int | None:
        """The latest registered hypothesis version (None when none is registered)."""
        versions = [h.version for h in self.data.hypotheses]
        return max(versions, default=None)

    def version_of(self, record: Record | dict[str, Any]) -> tuple[int | None, bool]:
        """(the hypothesis version a record was made under, whether it is inferred): the
        version it names, else the latest registered before its `created_at`."""
        if (version := record.get("hypothesis_version")) is not None:
            return version, False
        made = _instant(record.get("created_at"))
        if made is None:
            return None, False
        before = [
            h.version
            for h in self.data.hypotheses
            if (at := _instant(h.registered_at)) is not None and at <= made
        ]
        return max(before, default=None), True

    def made_under(self, record: Record | dict[str, Any]) -> str | None:
        """The note "made under hypothesis v1; current is v2" for a record of an earlier version
        than the current one (None for a current one, or one that says nothing of its time)."""
        current = self.current_version
        version, inferred = self.version_of(record)
        if current is None or (version is None and not inferred) or version == current:
            return None
        if version is None:
            return f"made before any hypothesis was registered; current is v{current}"
        how = " (the latest registered when it was made)" if inferred else ""
        return f"made under hypothesis v{version}{how}; current is v{current}"
