"""The dossier's section on the latest rental plan, set against the ledger's actual durations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunelab.stages.plan.review import RESOLUTION_S, far_off_remark, repeat_verdict, review_plan
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.units import percent, seconds


def _plan_row(ph: dict[str, Any], review: dict[str, dict[str, Any]]) -> list[Any]:
    """A plan phase against the review row of the same phase (planned, margin, actual)."""
    r = review.get(ph.get("phase"), {})
    within = ""
    if r.get("within_margin") is not None:
        within = ("yes" if r["within_margin"] else "no") + (
            f" (under {RESOLUTION_S:g} s)" if r.get("below_resolution") else ""
        )
        if r.get("far_off"):
            within += ", but far off"

    return [
        ph.get("phase") or ph.get("name"),
        seconds(r.get("planned_s", ph.get("total_s"))),
        percent(ph.get("margin_pct")),
        seconds(r.get("actual_s")),
        percent(r.get("error_pct"), signed=True),
        percent(r.get("error_at_run_speed_pct"), signed=True),
        within,
    ]


def plan_section(d: Dossier) -> Section:
    sec = Section("Rental plan and actual durations")
    if not d.data.plans:
        sec.text("No plan recorded.")
    for p in d.data.plans[-1:]:
        cost = p.get("cost") or {}
        price = p.get("gpu_hour_price")
        at = f" at {price:g} per GPU-hour" if isinstance(price, int | float) else ""
        sec.text(
            f"{p.get('days')} days on {p.get('device') or p.get('gpu')}{at}: "
            f"{p.get('variants_that_fit')} variants would fit, the study registers "
            f"{p.get('num_variants')}; busy {cost.get('busy_hours', 0):.2f} h (cost "
            f"{cost.get('busy_cost', 0):.2f}), rental {cost.get('rental_hours', 0):.0f} h "
            f"(cost {cost.get('rental_cost', 0):.2f}), in the price's currency."
        )
        # against the ledger as it is now: a plan made after the initial check has no actual
        # experiments in the review it stored
        reviewed = review_plan(d.study, p)
        review = {r.get("phase"): r for r in reviewed["rows"]}
        sec.table(
            ["phase", "planned", "margin", "actual", "error", "error at the runs' speed"]
            + ["within margin"],
            [_plan_row(ph, review) for ph in p.get("phases") or [] if isinstance(ph, dict)],
        )
        for r in review.values():
            if (verdict := repeat_verdict(r)) is not None:
                sec.text(verdict[0].upper() + verdict[1:] + ".")
            if (remark := far_off_remark(r)) is not None:
                sec.text("Far off: " + remark + ".")
        for note in reviewed["notes"]:
            sec.text(f"Note: {note}.")
        if p.get("gantt_png"):
            sec.image(Path(p["gantt_png"]), "rental plan")
        for w in p.get("warnings") or []:
            sec.text(f"warning: {w}")
    return sec
