"""The pieces of a rental plan (`record_types.Plan`), read typed: its cost and its phases.

Written by `stages.plan` (plans/plan-<stamp>.json). Each piece is a `Record` read at its place
in the plan, so a damaged one raises the located `StudyError` (core/record_base).
"""

from __future__ import annotations

from dataclasses import dataclass

from tunelab.core.record_base import Record

__all__ = ["PlanCost", "PlanPhase"]


@dataclass(frozen=True)
class PlanCost(Record):
    """Busy and rented GPU-hours, and their cost in the price's currency."""

    busy_hours: float | None = None
    busy_cost: float | None = None
    rental_hours: float | None = None
    rental_cost: float | None = None


@dataclass(frozen=True)
class PlanPhase(Record):
    """One phase of the plan: its planned seconds, margin and start in the rental window."""

    phase: str | None = None
    name: str | None = None  # the phase's name in plans that call it so
    start_s: float | None = None
    planned_s: float | None = None
    margin_s: float | None = None
    margin_pct: float | None = None
    total_s: float | None = None

    @property
    def title(self) -> str | None:
        return self.phase or self.name
