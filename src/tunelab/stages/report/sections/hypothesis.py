"""The dossier's section on the hypothesis, its guardrails and every amendment."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier, short


def hypothesis_section(d: Dossier) -> Section:
    sec = Section("Hypothesis and guardrails")
    if not d.data.hypotheses:
        sec.text("No hypothesis registered.")
    for h in d.data.hypotheses:
        sec.text(f"Version {h.version} registered {h.registered_at} (sha256 {short(h.sha256)}).")
        sec.table(["field", "value"], [[k, v] for k, v in h.statement.items()])
        sec.table(
            ["metric", "scope", "op", "value", "relative to"],
            [[g.metric, g.scope, g.op, g.value, g.relative_to or "absolute"] for g in h.guardrails],
            caption="guardrails",
        )
        if h.pins:  # what "main" meant when this version was locked: every stage loads that
            sec.table(
                ["what", "repo", "revision", "commit"],
                [[k, p.repo_id, p.revision, p.commit] for k, p in h.pins.items()],
                caption="hub repos pinned",
            )
        if h.changes:
            sec.table(
                ["field", "was", "now"],
                [[x.key, x.old, x.new] for x in h.changes],
                caption=f"amendment of version {h.version - 1}",
            )
    return sec
