"""The dossier's section on the latest inspection of preprocessing: lengths and truncation."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier, short
from tunelab.stages.report.units import share


def inspection_section(d: Dossier) -> Section:
    sec = Section("Inspection of preprocessing")
    if not d.data["inspections"]:
        sec.text("No inspection recorded.")
    for ins in d.data["inspections"][-1:]:
        sec.text(
            f"Inspection {ins.get('inspect_id')} of the {ins.get('split')} split ({ins.get('n')} examples, "
            f"template sha256 {short(ins.get('template_sha256'))}): "
            + (
                "every check passed."
                if ins.get("ok")
                else f"{len(ins.get('problems') or [])} problem(s) found."
            )
        )
        if stale := d.made_under(ins):
            sec.text(f"This inspection was {stale} (`tunelab inspect` makes a current one).")
        cats = {"all": ins.get("stats") or {}, **(ins.get("category_stats") or {})}
        sec.table(
            [
                "category",
                "n",
                "p50 (tokens)",
                "p95 (tokens)",
                "max (tokens)",
                "truncated",
                "target truncated",
            ],
            [
                [
                    c,
                    st.get("n"),
                    st.get("p50"),
                    st.get("p95"),
                    st.get("max"),
                    share(st.get("share_truncated")),
                    st.get("target_truncated"),
                ]
                for c, st in cats.items()
            ],
        )
    return sec
