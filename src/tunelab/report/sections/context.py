"""What every section builder reads: the collected records and the lookups built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tunelab.study import Study


def short(s: Any, n: int = 12) -> str:
    return str(s)[:n] if s else "-"


@dataclass
class Dossier:
    """The study, its collected records (`tunelab.report.collect.collect`) and the plot folder."""

    study: Study
    data: dict[str, Any]
    plot_dir: Path
    runs: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.runs = self.data["runs"]

    @cached_property
    def runs_by_id(self) -> dict[str, dict[str, Any]]:
        return {r["row"]["id"]: r for r in self.runs}

    @cached_property
    def evaluated(self) -> dict[str, dict[str, Any]]:
        """run id -> its validation evaluation record; eval runs are attributed to their parent.
        Smoke runs are left out: they evaluate a handful of examples to test the pipeline."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.runs:
            ev = r["evaluations"].get("validation")
            if ev is None or r["row"]["kind"] == "smoke":
                continue
            target = (
                r["row"]["parent"]
                if r["row"]["kind"] == "eval" and r["row"]["parent"]
                else r["row"]["id"]
            )
            out[target] = ev
        return out

    @cached_property
    def order(self) -> list[str]:
        """The evaluated runs, baselines first."""
        baselines = [
            r["row"]["id"]
            for r in self.runs
            if r["row"]["kind"] == "baseline" and r["row"]["id"] in self.evaluated
        ]
        return baselines + [i for i in self.evaluated if i not in set(baselines)]

    def label(self, run_id: str) -> str:
        """The name a user gave the run, else its id."""
        r = self.runs_by_id.get(run_id)
        if r is None:
            return run_id
        return r["row"]["name"] or r["row"]["id"]
