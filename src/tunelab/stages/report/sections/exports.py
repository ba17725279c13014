"""The dossier's section on the exports: where each is, its run and the base it is bound to."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier, short


def exports_section(d: Dossier) -> Section:
    sec = Section("Exports")
    if not d.data.exports:
        sec.text("No export recorded.")
    for ex in d.data.exports:
        base = ex.identity
        sec.text(
            f"{ex.path.parent}: run {ex.run_id}, base {base.name} "
            f"(identity sha256 {short(base.sha256)})."
        )
        made = {"hypothesis_version": ex.hypothesis_version}
        if stale := d.made_under(made):  # the version of the exported run
            sec.text(f"Its run was {stale}.")
    return sec
