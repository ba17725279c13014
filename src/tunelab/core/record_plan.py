"""Typed pieces of a plan record (`records/plans/<id>.json`, `core.record_types.Plan`), read
the way `core.record_base.Record` reads a record: each piece checks its fields and raises the
located `StudyError` of a damaged record naming the file, the place and the field.

| piece               | where in the plan record                     | written by           |
|---------------------|----------------------------------------------|----------------------|
| `PlanSchedule`      | the whole record: its durations              | stages.plan.estimate |
| `PlanInitial`       | `initial`                                    | stages.plan.estimate |
| `PlanVariant`       | `variant`                                    | stages.plan.estimate |
| `PlanPhase`         | `phases[i]`                                  | stages.plan.estimate |
| `PlanFigure`        | `figures.<name>`                             | stages.plan.figures  |
| `PlanProjection`    | `projection` (a `--gpu` plan)                | stages.plan.stage    |

`PlanSchedule` reads a whole plan record: `Plan`'s identity and the durations the review sets
against the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from tunelab.core.record_base import Record, damaged
from tunelab.core.record_types import Plan

R = TypeVar("R", bound=Record)

__all__ = [
    "PlanFigure",
    "PlanInitial",
    "PlanPhase",
    "PlanProjection",
    "PlanSchedule",
    "PlanVariant",
]


@dataclass(frozen=True)
class PlanInitial(Record):
    """The protocol's first day, in seconds: the smoke, the sizing and the baseline."""

    environment: float | None = None
    smoke: float = 0.0
    sizing: float = 0.0
    baseline: float = 0.0


@dataclass(frozen=True)
class PlanVariant(Record):
    """One variant's training run as planned, in seconds (`steps`: its optimizer steps)."""

    startup_s: float = 0.0
    steps: int = 0
    steps_s: float = 0.0
    validation_passes: int | None = None
    validation_s: float = 0.0
    checkpoint_saves: int | None = None
    checkpoints_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class PlanPhase(Record):
    """One phase of the plan: its name, seconds and margin."""

    phase: str = ""
    start_s: float | None = None
    planned_s: float | None = None
    total_s: float | None = None
    margin_pct: float | None = None


@dataclass(frozen=True)
class PlanFigure(Record):
    """One input figure of the plan, with its source."""

    value: float | None = None
    source: str | None = None


@dataclass(frozen=True)
class PlanProjection(Record):
    """How a `--gpu` plan was projected: the catalog GPU it is for."""

    gpu: str = ""
    gpu_name: str | None = None
    currency: str | None = None  # the catalog's prices'


@dataclass(frozen=True)
class PlanSchedule(Plan):
    """A plan record with the durations the review reads back (`Plan` is its identity)."""

    step_time_s: float = 0.0
    busy_s: float | None = None
    window_s: float | None = None
    evaluation_run_s: float = 0.0
    verify_s: float = 0.0
    resume_each_s: float = 0.0
    export_s: float = 0.0
    num_variants: int = 0

    @property
    def initial(self) -> PlanInitial:
        return self._required(PlanInitial, "initial")

    @property
    def variant(self) -> PlanVariant:
        return self._required(PlanVariant, "variant")

    @property
    def phases(self) -> list[PlanPhase]:
        return self.parts(PlanPhase, "phases")

    @property
    def projection(self) -> PlanProjection | None:
        return self.part(PlanProjection, "projection")

    def figure(self, name: str) -> float | None:
        """The value of input figure `name` (None where the plan has none)."""
        found = self.input_figure(name)
        return found.value if found is not None else None

    def input_figure(self, name: str) -> PlanFigure | None:
        """Input figure `name` with its source (None where the plan has none; `figures` also
        holds values that are not figures: the device, the counts, the method)."""
        figures = self.raw.get("figures") or {}
        if not isinstance(figures, dict) or figures.get(name) is None:
            return None
        return PlanFigure.of(self.path, figures[name], f"figures.{name}")

    def _required(self, cls: type[R], name: str) -> R:
        found = self.part(cls, name)
        if found is None:
            raise damaged(self.path, f"field {name!r} is missing")
        return found

    def check_parts(self) -> None:
        _ = self.initial, self.variant, self.phases, self.projection
