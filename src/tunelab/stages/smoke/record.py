"""Where a study's latest smoke record is found (the planner and the sizing read its timings).

`latest_smoke(study) -> (smoke.json, ledger row)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunelab.core.records import read_json

if TYPE_CHECKING:
    from tunelab.core.study import Study


def latest_smoke(study: Study) -> tuple[dict[str, Any] | None, Any]:
    """The newest completed smoke's smoke.json and its ledger row, or (None, None)."""
    rows = [r for r in study.ledger.list_runs("smoke") if r.status == "completed"]
    for row in reversed(rows):
        path = study.runs_dir / row.id / "smoke.json"
        if path.exists():
            return read_json(path), row
    return None, None
