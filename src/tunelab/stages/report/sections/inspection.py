"""The dossier's section on the latest inspection of preprocessing: lengths and truncation."""

from __future__ import annotations

from tunelab.core.record_inspect import LengthStats
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier, short
from tunelab.stages.report.units import share


def inspection_section(d: Dossier) -> Section:
    sec = Section("Inspection of preprocessing")
    if not d.data.inspections:
        sec.text("No inspection recorded.")
    for ins in d.data.inspections[-1:]:
        sec.text(
            f"Inspection {ins.inspect_id} of the {ins.split} split ({ins.n} examples, "
            f"template sha256 {short(ins.template_sha256)}): "
            + ("every check passed." if ins.ok else f"{len(ins.problems or [])} problem(s) found.")
        )
        if stale := d.made_under(ins):
            sec.text(f"This inspection was {stale} (`tunelab inspect` makes a current one).")
        cats = {"all": ins.stats or LengthStats(ins.path, {}), **ins.category_stats}
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
                [c, st.n, st.p50, st.p95, st.max, share(st.share_truncated),
                 st.target_truncated]
                for c, st in cats.items()
            ],
        )  # fmt: skip
    return sec
