"""The dossier's section on the latest rental plan, set against the ledger's actual durations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunelab.core.record_plan import PlanPhase, PlanReviewRow
from tunelab.stages.plan.review import RESOLUTION_S, far_off_remark, plan_review, repeat_verdict
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.units import percent, seconds


def _plan_row(ph: PlanPhase, r: PlanReviewRow | None) -> list[Any]:
    """A plan phase against the review row of the same phase (planned, margin, actual); the
    review's rows are `stages.plan.review.plan_review`'s."""
    within = ""
    if r is not None and r.within_margin is not None:
        within = ("yes" if r.within_margin else "no") + (
            f" (under {RESOLUTION_S:g} s)" if r.below_resolution else ""
        )
        if r.far_off:
            within += ", but far off"
    return [
        ph.phase,
        seconds(ph.total_s if r is None else r.planned_s),
        percent(ph.margin_pct),
        seconds(None if r is None else r.actual_s),
        percent(None if r is None else r.error_pct, signed=True),
        percent(None if r is None else r.error_at_run_speed_pct, signed=True),
        within,
    ]


def plan_section(d: Dossier) -> Section:
    sec = Section("Rental plan and actual durations")
    if not d.data.plans:
        sec.text("No plan recorded.")
    for p in d.data.plans[-1:]:
        cost = p.cost
        at = f" at {p.gpu_hour_price:g} per GPU-hour" if p.gpu_hour_price is not None else ""
        sec.text(
            f"{p.days} days on {p.device or p.gpu}{at}: "
            f"{p.variants_that_fit} variants would fit, the study registers "
            f"{p.num_variants}; busy {cost.busy_hours or 0:.2f} h (cost "
            f"{cost.busy_cost or 0:.2f}), rental {cost.rental_hours or 0:.0f} h "
            f"(cost {cost.rental_cost or 0:.2f}), in the price's currency."
        )
        # against the ledger as it is now: a plan made after the initial check has no actual
        # experiments in the review it stored
        reviewed = plan_review(d.study, p.raw)
        review = {r.phase: r for r in reviewed.rows}
        sec.table(
            ["phase", "planned", "margin", "actual", "error", "error at the runs' speed"]
            + ["within margin"],
            [_plan_row(ph, review.get(ph.phase)) for ph in p.phases],
        )
        for r in review.values():
            if (verdict := repeat_verdict(r)) is not None:
                sec.text(verdict[0].upper() + verdict[1:] + ".")
            if (remark := far_off_remark(r)) is not None:
                sec.text("Far off: " + remark + ".")
        for note in reviewed.notes or []:
            sec.text(f"Note: {note}.")
        if p.gantt_png:
            sec.image(Path(p.gantt_png), "rental plan")
        for w in p.warnings or []:
            sec.text(f"warning: {w}")
    return sec
