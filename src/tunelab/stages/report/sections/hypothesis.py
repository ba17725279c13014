"""The dossier's section on the hypothesis, its guardrails and every amendment."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier, short


def hypothesis_section(d: Dossier) -> Section:
    sec = Section("Hypothesis and guardrails")
    if not d.data["hypotheses"]:
        sec.text("No hypothesis registered.")
    for h in d.data["hypotheses"]:
        c = h["content"]
        sec.text(
            f"Version {h['version']} registered {h['registered_at']} (sha256 {short(h['sha256'])})."
        )
        sec.table(["field", "value"], [[k, v] for k, v in c["hypothesis"].items()])
        sec.table(
            ["metric", "scope", "op", "value", "relative to"],
            [
                [g["metric"], g["scope"], g["op"], g["value"], g.get("relative_to") or "absolute"]
                for g in c["guardrails"]
            ],
            caption="guardrails",
        )
        pins = c.get("pins") or {}
        if pins:  # what "main" meant when this version was locked: every stage loads that
            sec.table(
                ["what", "repo", "revision", "commit"],
                [[k, p["repo_id"], p["revision"], p["commit"]] for k, p in pins.items()],
                caption="hub repos pinned",
            )
        if h.get("diff"):
            sec.table(
                ["field", "was", "now"],
                [[x["path"], x["old"], x["new"]] for x in h["diff"]],
                caption=f"amendment of version {h['version'] - 1}",
            )
    return sec
