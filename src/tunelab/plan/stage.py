"""`tunelab plan`: gather the figures, build the plan, record it with its chart."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.errors import ConfigError
from tunelab.ledger import utc_now
from tunelab.plan.chart import draw_gantt
from tunelab.plan.estimate import build_plan
from tunelab.plan.figures import gather_figures
from tunelab.plan.review import review_plan
from tunelab.plan.stored import plans_dir
from tunelab.records import write_json_atomic
from tunelab.study import Study


def make_plan(
    study: Study,
    *,
    days: int | None = None,
    gpu_hour_price: float | None = None,
    speedup: float = 1.0,
    step_time_s: float | None = None,
) -> tuple[dict[str, Any], Path, Path]:
    """Gather the figures, build the plan, write records/plans/<id>.json and <id>.png.

    Returns (the record, its path, the chart's path). Raises ConfigError for a rental length
    other than 3, 7 or 30 days or a non-positive speed-up or step time."""
    cfg = study.config
    days = int(days or cfg.budget.rental_days)
    if days not in (3, 7, 30):
        raise ConfigError(f"--days {days}: plans are for 3, 7 or 30 days", hint="--days 3|7|30")
    if speedup <= 0 or (step_time_s is not None and step_time_s <= 0):
        raise ConfigError("--speedup and --step-time-s must be positive", hint="e.g. --speedup 20")
    figures = gather_figures(study)
    plan = build_plan(
        figures,
        cfg,
        days=days,
        gpu_hour_price=gpu_hour_price,
        speedup=speedup,
        step_time_s=step_time_s,
    )
    plan_id = f"plan-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    folder = plans_dir(study)
    record = {
        "id": plan_id,
        "kind": "plan",
        "created_at": utc_now(),
        "config_sha256": cfg.sha256(),
        "figures": figures.to_dict(),
        **plan.to_dict(),
        "chart": f"{plan_id}.png",
        "gantt_png": str(folder / f"{plan_id}.png"),
    }
    # what the ledger already holds, set against this plan (the report shows it)
    record["review"] = review_plan(study, record)
    actual = {r["phase"]: r["actual_s"] for r in record["review"]["rows"]}
    for ph in record["phases"]:
        ph["name"] = ph["phase"]
        ph["planned_h"] = round(ph["total_s"] / 3600, 4)
        ph["actual_h"] = (
            None if not actual.get(ph["phase"]) else round(actual[ph["phase"]] / 3600, 4)
        )
    png = draw_gantt(plan, folder / f"{plan_id}.png")
    path = write_json_atomic(folder / f"{plan_id}.json", record)
    study.ledger.add_event(
        None, "plan:recorded", {"id": plan_id, "fits": plan.fits, "busy_s": plan.busy_s}
    )
    return record, path, png
