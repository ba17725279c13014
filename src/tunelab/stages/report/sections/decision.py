"""The dossier's first section: a summary of the decision (the adopted variant, its primary
metric with the interval, its guardrails, its test figure), then the decision in words."""

from __future__ import annotations

from typing import Any

from tunelab.core.record_parts import CompareEntry
from tunelab.core.record_types import Compare
from tunelab.stages.report.decision import (
    TestFigure,
    choose_variant,
    decide,
    final_test,
    format_ci,
    test_figure,
)
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier


def _closest(compare: Compare) -> CompareEntry | None:
    """The compared variant with the largest primary-metric gain (what a reader looks at when
    none is adopted)."""
    compared = [r for r in compare.runs if r.compared]
    return max(compared, key=lambda r: r.primary.delta or 0.0, default=None)


def _test_row(t: TestFigure | None, openings: int = 0) -> str:
    if t is None and openings:
        # a run that is not adopted may still have opened the split: never say "not opened"
        times = "once" if openings == 1 else f"{openings} times"
        return f"opened {times}, though no variant is adopted (each opening under Limitations)"
    if t is None:
        return "not opened: no variant is adopted"
    if t.eval_run is None:
        return f"not opened yet: `tunelab eval {t.run_id} --split test --final`"
    times = "its only opening" if t.openings == 1 else f"opened {t.openings} times in all"
    value = f"{t.value:.4f}" if isinstance(t.value, float) else str(t.value)
    return f"{t.metric} {value} on {t.n} examples ({times})"


def _summary(compare: Compare, test: TestFigure | None, openings: int = 0) -> list[list[Any]]:
    chosen, _ = choose_variant(compare)
    shown = chosen or _closest(compare)
    if shown is None:
        return [["adopted variant", "none: no variant was compared"]]
    p = shown.primary

    def num(x: Any) -> str:
        return f"{x:.4f}" if isinstance(x, int | float) else "-"

    if shown.decision is not None:
        return _summary_with_verdicts(compare, shown, chosen is not None, test, openings)
    passing = sum(1 for g in shown.guardrails if g.passed)
    return [
        [
            "adopted variant",
            f"{shown.label} (run {shown.run_id})"
            if chosen
            else f"none: the baseline is kept (closest: {shown.label})",
        ],
        [
            f"primary metric ({compare.primary_metric}, validation)",
            f"{num(p.baseline)} -> {num(p.variant)}, delta "
            f"{'-' if p.delta is None else f'{p.delta:+.4f}'}, 95 % CI {format_ci(p)}"
            f" (minimum improvement {compare.min_improvement})",
        ],
        ["guardrails", f"{passing} of {len(shown.guardrails)} checks pass"],
        ["sealed test split", _test_row(test, openings)],
    ]


def _summary_with_verdicts(
    compare: Compare, shown: CompareEntry, adopted: bool, test: Any, openings: int
) -> list[list[Any]]:
    """The summary of a compare record with verdicts: the decision, the primary test on its
    interval, each guardrail verdict with the adjusted level, the flips per category."""
    tests = compare.tests
    name, p, guards, fl = shown.label, shown.primary, shown.guardrails, shown.flips
    counts = {v: sum(1 for g in guards if g.verdict == v) for v in _VERDICTS}
    levels = [g.adjusted_level for g in guards if g.adjusted_level is not None]
    adjusted = f", fail side {tests.multiplicity}-adjusted to {min(levels):.3g}" if levels else ""
    by_cat = fl.by_category or {}
    per = ", ".join(f"{c} +{v['improved']}/-{v['regressed']}" for c, v in by_cat.items())
    what = "adopt" if adopted else compare.decision or "reject"
    goal = "equivalence (TOST)" if tests.goal == "equivalence" else "superiority"
    return [
        [
            "adopted variant",
            f"{name} (run {shown.run_id})" if adopted else f"none (closest: {name})",
        ],
        ["decision", what],
        [
            f"primary metric ({compare.primary_metric}, validation)",
            f"{p.baseline:.4f} -> {p.variant:.4f}, delta {p.delta or 0.0:+.4f}, "
            f"{tests.level:.0%} CI {format_ci(p)}: {goal} {p.verdict} "
            f"(minimum improvement {compare.min_improvement})",
        ],
        [
            "guardrails",
            f"{counts['pass']} pass, {counts['fail']} fail, {counts['inconclusive']} inconclusive "
            f"of {len(guards)} (one-sided level {tests.one_sided:.3g}{adjusted})",
        ],
        [
            "flips",
            f"{fl.num_improved or 0} wrong -> right, {fl.num_regressed or 0} right -> wrong"
            + (f" (per category {per})" if per else ""),
        ],
        ["sealed test split", _test_row(test, openings)],
    ]


_VERDICTS = ("pass", "fail", "inconclusive")


def decision_section(d: Dossier) -> Section:
    sec = Section("Decision")
    if not d.data.compares:
        return sec.text("No comparison has been recorded yet: no decision. Run `tunelab compare`.")
    latest = d.data.compares[-1]
    openings = d.data.test_openings
    rows = _summary(latest, test_figure(latest, d.runs, openings), len(openings))
    stale = d.made_under(latest.raw)
    if stale:  # the rule and guardrails applied are the earlier version's
        rows.append(["hypothesis", stale.replace("hypothesis ", "", 1)])
    sec.table(["what", "value"], rows, caption="decision summary")
    test = final_test(latest, d.runs, openings)
    sec.text(decide(latest))
    under = (
        f"{stale}; `tunelab compare` decides under the current one"
        if stale
        else f"hypothesis v{latest.hypothesis_version}"
    )
    sec.text(f"From comparison {latest.id} on the {latest.split} split ({under}).")
    return sec.text(test) if test else sec
