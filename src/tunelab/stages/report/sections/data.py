"""The dossier's section on the latest data snapshot: counts per split and category, duplicates."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier


def data_section(d: Dossier) -> Section:
    sec = Section("Data")
    if not d.data["data"]:
        sec.text("No data snapshot recorded.")
    for m in d.data["data"][-1:]:
        src = m.get("source") or {}
        hub = src.get("hub")
        where = (
            f"hub data set {hub['repo_id']} at commit {hub['commit']}"
            if hub
            else f"{src.get('path')} ({src.get('format')})"
        )
        sec.text(
            f"Snapshot {m.get('snapshot_id')} created {m.get('created_at')} from {where}, "
            f"{src.get('num_files')} file(s)."
        )
        counts = m.get("counts") or {}
        per = counts.get("per_category") or {}
        if per:
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
        dup = m.get("duplicates") or {}
        sec.text(
            f"{counts.get('rows_read')} rows read, {counts.get('dropped_by_cleaning')} dropped by cleaning, "
            f"{counts.get('sampled_out', 0)} sampled out, {counts.get('removed_as_duplicates')} removed as "
            f"duplicates (policy {(m.get('dedup') or {}).get('policy')})."
        )
        if dup:
            sec.table(
                ["what", "value"],
                [[k, v] for k, v in dup.items() if not isinstance(v, list | dict)],
                caption="duplicates",
            )
    return sec
