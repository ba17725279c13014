"""Where plans are kept: `records/plans/<plan-id>.json` beside its chart `<plan-id>.png`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunelab.records import read_json
from tunelab.study import Study


def plans_dir(study: Study) -> Path:
    return study.records / "plans"


def latest_plan(study: Study) -> dict[str, Any] | None:
    """The newest plan record, or None."""
    found = sorted(plans_dir(study).glob("plan-*.json")) if plans_dir(study).is_dir() else []
    return read_json(found[-1]) if found else None
