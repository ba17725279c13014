"""The dossier's first section: the decision of the latest comparison, and the test figure."""

from __future__ import annotations

from tunelab.report.decision import decide, final_test
from tunelab.report.document import Section
from tunelab.report.sections.context import Dossier


def decision_section(d: Dossier) -> Section:
    sec = Section("Decision")
    if not d.data["compares"]:
        return sec.text("No comparison has been recorded yet: no decision. Run `tunelab compare`.")
    latest = d.data["compares"][-1]
    sec.text(decide(latest))
    sec.text(
        f"From comparison {latest.get('id')} on the {latest.get('split')} split "
        f"(hypothesis v{latest.get('hypothesis_version')})."
    )
    test = final_test(latest, d.runs, d.data["test_openings"])
    return sec.text(test) if test else sec
