"""The dossier's first section: a summary of the decision (the adopted variant, its primary
metric with the interval, its guardrails, its test figure), then the decision in words."""

from __future__ import annotations

from typing import Any

from tunelab.stages.report.decision import (
    choose_variant,
    decide,
    final_test,
    format_ci,
    test_figure,
)
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier


def _closest(compare: dict[str, Any]) -> dict[str, Any] | None:
    """The compared variant with the largest primary-metric gain (what a reader looks at when
    none is adopted)."""
    compared = [r for r in compare.get("runs", []) if r.get("compared")]
    return max(compared, key=lambda r: (r.get("primary") or {}).get("delta") or 0.0, default=None)


def _test_row(t: dict[str, Any] | None, openings: int = 0) -> str:
    if t is None and openings:
        # a run that is not adopted may still have opened the split: never say "not opened"
        times = "once" if openings == 1 else f"{openings} times"
        return f"opened {times}, though no variant is adopted (each opening under Limitations)"
    if t is None:
        return "not opened: no variant is adopted"
    if t["eval_run"] is None:
        return f"not opened yet: `tunelab eval {t['run_id']} --split test --final`"
    times = "its only opening" if t["openings"] == 1 else f"opened {t['openings']} times in all"
    value = f"{t['value']:.4f}" if isinstance(t["value"], float) else str(t["value"])
    return f"{t['metric']} {value} on {t['n']} examples ({times})"


def _summary(
    compare: dict[str, Any], test: dict[str, Any] | None, openings: int = 0
) -> list[list[Any]]:
    metric = compare.get("primary_metric")
    chosen, _ = choose_variant(compare)
    shown = chosen or _closest(compare)
    if shown is None:
        return [["adopted variant", "none: no variant was compared"]]
    name = shown.get("name") or shown.get("run_id")
    p = shown.get("primary") or {}
    guards = shown.get("guardrails") or []
    passing = sum(1 for g in guards if g.get("pass"))

    def num(x: Any) -> str:
        return f"{x:.4f}" if isinstance(x, int | float) else "-"

    delta = p.get("delta")
    if "decision" in shown:
        return _summary_with_verdicts(compare, shown, chosen is not None, test, openings)
    return [
        [
            "adopted variant",
            f"{name} (run {shown.get('run_id')})"
            if chosen
            else f"none: the baseline is kept (closest: {name})",
        ],
        [
            f"primary metric ({metric}, validation)",
            f"{num(p.get('baseline'))} -> {num(p.get('variant'))}, delta "
            f"{'-' if delta is None else f'{delta:+.4f}'}, 95 % CI {format_ci(p)}"
            f" (minimum improvement {compare.get('min_improvement')})",
        ],
        ["guardrails", f"{passing} of {len(guards)} checks pass"],
        ["sealed test split", _test_row(test, openings)],
    ]


def _summary_with_verdicts(
    compare: dict[str, Any], shown: dict[str, Any], adopted: bool, test: Any, openings: int
) -> list[list[Any]]:
    """The summary of a compare record with verdicts: the decision, the primary test on its
    interval, each guardrail verdict with the adjusted level, the flips per category."""
    tests = compare.get("tests") or {}
    name = shown.get("name") or shown.get("run_id")
    p = shown.get("primary") or {}
    guards = shown.get("guardrails") or []
    counts = {v: sum(1 for g in guards if g.get("verdict") == v) for v in _VERDICTS}
    levels = [g["adjusted_level"] for g in guards if g.get("adjusted_level") is not None]
    adjusted = (
        f", fail side {tests.get('multiplicity')}-adjusted to {min(levels):.3g}" if levels else ""
    )
    fl = shown.get("flips") or {}
    by_cat = fl.get("by_category") or {}
    per = ", ".join(f"{c} +{v['improved']}/-{v['regressed']}" for c, v in by_cat.items())
    what = "adopt" if adopted else compare.get("decision", "reject")
    goal = "equivalence (TOST)" if tests.get("goal") == "equivalence" else "superiority"
    return [
        [
            "adopted variant",
            f"{name} (run {shown.get('run_id')})" if adopted else f"none (closest: {name})",
        ],
        ["decision", what],
        [
            f"primary metric ({compare.get('primary_metric')}, validation)",
            f"{p.get('baseline'):.4f} -> {p.get('variant'):.4f}, delta {p.get('delta') or 0.0:+.4f}, "
            f"{tests.get('confidence', 0.95):.0%} CI {format_ci(p)}: {goal} {p.get('verdict')} "
            f"(minimum improvement {compare.get('min_improvement')})",
        ],
        [
            "guardrails",
            f"{counts['pass']} pass, {counts['fail']} fail, {counts['inconclusive']} inconclusive "
            f"of {len(guards)} (one-sided level {tests.get('alpha', 0.025):.3g}{adjusted})",
        ],
        [
            "flips",
            f"{fl.get('num_improved', 0)} wrong -> right, {fl.get('num_regressed', 0)} right -> wrong"
            + (f" (per category {per})" if per else ""),
        ],
        ["sealed test split", _test_row(test, openings)],
    ]


_VERDICTS = ("pass", "fail", "inconclusive")


def decision_section(d: Dossier) -> Section:
    sec = Section("Decision")
    if not d.data["compares"]:
        return sec.text("No comparison has been recorded yet: no decision. Run `tunelab compare`.")
    latest = d.data["compares"][-1]
    openings = d.data["test_openings"]
    rows = _summary(latest, test_figure(latest, d.runs, openings), len(openings))
    stale = d.made_under(latest)
    if stale:  # the rule and guardrails applied are the earlier version's
        rows.append(["hypothesis", stale.replace("hypothesis ", "", 1)])
    sec.table(["what", "value"], rows, caption="decision summary")
    test = final_test(latest, d.runs, openings)
    sec.text(decide(latest))
    under = (
        f"{stale}; `tunelab compare` decides under the current one"
        if stale
        else f"hypothesis v{latest.get('hypothesis_version')}"
    )
    sec.text(f"From comparison {latest.get('id')} on the {latest.get('split')} split ({under}).")
    return sec.text(test) if test else sec
