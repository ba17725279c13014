"""The dossier's last section: test-split openings, answers the generation budget cuts, runs
that did not complete, and the exports' own limitations."""

from __future__ import annotations

from typing import Any

from tunelab.stages.report.collect import RunEvidence
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier


def _over_budget(sec: Section, runs: list[RunEvidence]) -> None:
    """Answers the generation budget cuts: every model is scored wrong on them."""
    over: dict[str, tuple[int, int, Any]] = {}
    for r in runs:
        for split, ev in r.evaluations.items():
            count = ev.decoding.answers_over_budget if ev.decoding else None
            if count:
                over[split] = (count, ev.n, ev.max_new_tokens)
    for split, (count, n, budget) in sorted(over.items()):
        # the test split is sealed: inspect does not open it
        names = f" (`tunelab inspect --split {split}` names them)" if split != "test" else ""
        sec.text(
            f"{count} of the {n} evaluated {split} answers are longer than "
            f"evaluation.max_new_tokens ({budget}): generation stops before their end, so no "
            f"model can be judged right on them{names}."
        )


def limitations_section(d: Dossier) -> Section:
    sec = Section("Limitations")
    openings = d.data.test_openings
    sec.text(
        f"The sealed test split was opened {len(openings)} time(s)."
        + (
            " More than once: test results are no longer an untouched control."
            if len(openings) > 1
            else ""
        )
    )
    if openings:
        sec.table(
            ["at", "who", "why", "run"],
            [[o.at, o.who, o.why, o.run_id] for o in openings],
        )
    _over_budget(sec, d.runs)
    failed = [r for r in d.runs if r.row.status in ("failed", "invalid", "interrupted")]
    if failed:
        sec.text(
            f"{len(failed)} run(s) did not complete; they are listed above with their reasons."
        )
    for ex in d.data.exports:
        for lim in ex.limitations or []:
            sec.text(str(lim))
    unreadable = d.data.unreadable
    if unreadable:
        sec.text(
            f"{len(unreadable)} record(s) could not be read; the sections above leave them out "
            "(restore each from a copy and build the dossier again):"
        )
        sec.table(["record", "problem"], [[u.path, u.error] for u in unreadable])
    return sec
