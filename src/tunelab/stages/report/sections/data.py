"""The dossier's section on the latest data snapshot: counts per split and category, duplicates."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier


def data_section(d: Dossier) -> Section:
    sec = Section("Data")
    if not d.data.data:
        sec.text("No data snapshot recorded.")
    for m in d.data.data[-1:]:
        src, counts, dup = m.source, m.counts, m.duplicates
        hub = src.hub
        where = (
            f"hub data set {hub.repo_id} at commit {hub.commit}"
            if hub
            else f"{src.source_path} ({src.format})"
        )
        sec.text(
            f"Snapshot {m.snapshot_id} created {m.created_at} from {where}, "
            f"{src.num_files} file(s)."
        )
        if per := counts.per_category or {}:
            # one row per category: a study may have dozens, a page has room for few columns
            cats = sorted({c for split in per.values() for c in split})
            sec.table(
                ["category", *per, "total"],
                [[c, *(per[s].get(c, 0) for s in per), sum(per[s].get(c, 0) for s in per)]
                 for c in cats]
                + [["total", *(sum(per[s].values()) for s in per),
                    sum(sum(v.values()) for v in per.values())]],
                caption="examples per category and split",
            )  # fmt: skip
        sec.text(
            f"{counts.rows_read} rows read, {counts.dropped_by_cleaning} dropped by cleaning, "
            f"{counts.sampled_out or 0} sampled out, {counts.removed_as_duplicates} removed as "
            f"duplicates (policy {m.dedup.policy})."
        )
        if dup.raw:
            sec.table(["what", "value"], [list(f) for f in dup.figures()], caption="duplicates")
    return sec
