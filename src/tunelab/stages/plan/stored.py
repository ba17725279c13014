"""Where plans are kept: `records/plans/<plan-id>.json` beside its chart `<plan-id>.png`.

`plans_in_order(study, on_damaged=None)` (oldest first, as the dossier reads them), `plans_dir`.
The latest plan is `core.evidence.latest(study, "plan")` (the largest `created_ns`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunelab.core.errors import StudyError
from tunelab.core.record_types import Plan
from tunelab.core.study import Study


def plans_dir(study: Study) -> Path:
    return study.records / "plans"


def creation_ns() -> int:
    """A plan record's `created_ns`: nanoseconds since the epoch, what orders plans (an id
    carries whole seconds only, so two plans of one second would tie)."""
    return time.time_ns()


def _creation_order(plan: Plan) -> tuple[int, str]:
    # a record without created_ns sorts by its id, before every record that has one
    return (plan.created_ns or 0, plan.id)


def plans_in_order(
    study: Study, on_damaged: Callable[[Path, StudyError], None] | None = None
) -> list[dict[str, Any]]:
    """Every plan record as written, oldest first (each with `_path`, where it was read from).
    A damaged record (not JSON, or not a plan: `core.record_types.Plan`) is not a plan to show
    or review: it is left out and passed to `on_damaged`."""
    folder = plans_dir(study)
    plans = []
    for path in folder.glob("plan-*.json") if folder.is_dir() else []:
        try:
            plans.append(Plan.read(path))
        except StudyError as exc:
            if on_damaged is not None:
                on_damaged(path, exc)
    return [{**p.raw, "_path": str(p.path)} for p in sorted(plans, key=_creation_order)]
