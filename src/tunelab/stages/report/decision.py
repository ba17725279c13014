"""The decision the records support, and the adopted variant's figure on the sealed test split.

Pure: a compare record (and the collected runs) in, a choice and sentences out. The dossier's
decision and `tunelab demo` (which opens the test split for the adopted variant only) share
the rule.

Every function takes the compare record typed (`core.record_types.Compare`; a record built in
memory is checked with `Compare.of(where, record)`).

- `choose_variant(compare_record) -> (row | None, reasons)`: the compared variant with the
  largest primary-metric gain meeting `min_improvement`, with a 95 % interval above 0 and every
  guardrail passing; `decide(compare_record) -> str` (the dossier's sentence).
- `test_figure(compare_record, runs, test_openings) -> TestFigure | None` (the summary row:
  name, run_id, metric, eval_run, n, value, openings, validation; `eval_run` None until the split
  is opened); `final_test(compare_record, runs, test_openings) -> str | None` (the adopted variant's primary
  metric on the test split, from the eval run that opened it first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tunelab.core.record_parts import CompareEntry
from tunelab.core.record_types import Compare

if TYPE_CHECKING:
    from tunelab.core.ledger import SealedOpening
    from tunelab.stages.report.collect import RunEvidence


def format_ci(d: Any) -> str:
    """A 95 % interval (an object with `ci_low`, `ci_high`) as [low, high] with signs, "-" when
    it is missing."""
    if d is None or d.ci_low is None or d.ci_high is None:
        return "-"
    return f"[{d.ci_low:+.4f}, {d.ci_high:+.4f}]"


def choose_variant(compare: Compare) -> tuple[CompareEntry | None, list[str]]:
    """The compared variant with the largest gain in the primary metric whose decision is
    adopt (its compare row, or None), and why each other variant was not chosen. A compare
    record from before decisions were recorded is read by its rule: the delta meets the
    registered minimum improvement with a 95 % interval above 0 and every guardrail passes."""
    metric = compare.primary_metric
    candidates, reasons = [], []
    for r in compare.runs:
        name = r.label
        if not r.compared:
            reasons.append(
                f"{name}: not compared ({r.not_compared_reason or r.reason or r.status})"
            )
            continue
        p = r.primary
        if r.decision is not None:
            if r.decision == "adopt":
                candidates.append((p.delta or 0.0, name, r))
            else:
                reasons.append(f"{name}: {r.decision}: " + "; ".join(r.decision_reasons or []))
            continue
        failed = [g for g in r.guardrails if not g.passed]
        if failed:
            reasons.append(
                f"{name}: {len(failed)} guardrail(s) fail, e.g. {failed[0].rule} "
                f"on {failed[0].item or 'overall'}"
            )
        elif not p.meets_min_improvement:
            reasons.append(
                f"{name}: {metric} delta {p.delta} is below the registered minimum "
                f"{compare.min_improvement}"
            )
        elif not p.significant:
            reasons.append(f"{name}: the 95 % interval of the {metric} delta includes 0")
        else:
            candidates.append((p.delta or 0.0, name, r))
    if not candidates:
        return None, reasons
    return max(candidates, key=lambda c: c[0])[2], reasons


def decide(compare: Compare) -> str:
    """The decision as a sentence: adopt the chosen variant, or keep the baseline, saying why."""
    metric = compare.primary_metric
    r, reasons = choose_variant(compare)
    if r is not None:
        p = r.primary
        flags = f" Flags: {'; '.join(r.flags)}." if r.flags else ""
        if r.decision is not None:
            return f"Adopt {r.label} (run {r.run_id}): {_adopted_because(compare, r)}.{flags}"
        return (
            f"Adopt {r.label} (run {r.run_id}): {metric} {p.baseline:.4f} -> "
            f"{p.variant:.4f} (delta {p.delta or 0.0:+.4f}, 95 % CI {format_ci(p)}), all "
            f"{len(r.guardrails)} guardrail checks pass.{flags}"
        )
    if compare.decision == "inconclusive":
        return (
            "Inconclusive: no variant is adopted and none is ruled out. "
            + "; ".join(reasons)
            + ". "
            + _what_settles(compare)
        )
    return (
        "Keep the baseline: " + ("; ".join(reasons) if reasons else "no variant was compared") + "."
    )


def _what_settles(compare: Compare) -> str:
    """What would settle an inconclusive comparison: more validation examples (the largest
    split size its inconclusive tests name), or the sealed test split, opened once."""
    sizes = [
        n
        for r in compare.runs
        if r.decision == "inconclusive"
        for n in [r.primary.settle_n] + [g.settle_n for g in r.guardrails]
        if n
    ]
    more = f"about {max(sizes)} validation examples would likely settle it" if sizes else ""
    final = "the sealed test split, opened once with `tunelab eval RUN --split test --final`"
    return f"What would settle it: {more + ', or ' if more else ''}{final}."


def _adopted_because(compare: Compare, r: CompareEntry) -> str:
    """The adopted row's evidence: the primary test with its interval, the guardrails with
    the adjusted level, the flips."""
    p, tests = r.primary, compare.tests
    guards = r.guardrails
    levels = [g.adjusted_level for g in guards if g.adjusted_level is not None]
    fl = r.flips
    level = f"; fail side at {tests.multiplicity}-adjusted levels down to {min(levels):.3g}"
    return (
        f"{compare.primary_metric} {p.baseline:.4f} -> {p.variant:.4f}, "
        f"delta {p.delta or 0.0:+.4f}, {tests.level:.0%} interval "
        f"{format_ci(p)}: {p.verdict} (one-sided level {tests.one_sided:.3g}); "
        f"all {len(guards)} guardrail checks pass on their interval bounds"
        + (level if levels else "")
        + f"; {fl.num_improved or 0} examples wrong -> right, "
        f"{fl.num_regressed or 0} right -> wrong"
    )


@dataclass(frozen=True)
class TestFigure:
    """The adopted variant on the sealed test split (`eval_run` None until it is opened)."""

    __test__ = False  # not a pytest class

    name: str
    run_id: str
    metric: str | None
    eval_run: str | None
    n: int | None
    value: Any
    openings: int
    validation: float | None


def test_figure(
    compare: Compare, runs: Sequence[RunEvidence], openings: Sequence[SealedOpening]
) -> TestFigure | None:
    """The adopted variant on the sealed test split, from the evaluation that opened it first:
    `{name, run_id, metric, eval_run, n, value, openings, validation}` (`eval_run` None while
    it has not been evaluated there); None when no variant is adopted.

    `runs` are the dossier's collected runs (`RunEvidence`: `row`, `evaluations` by split); `openings` the
    ledger's test openings, each naming the eval run that opened the split."""
    chosen, _ = choose_variant(compare)
    if chosen is None:
        return None
    run_id = chosen.run_id
    metric = compare.primary_metric
    tests = {
        r.row.id: r
        for r in runs
        if r.row.kind == "eval" and r.row.parent == run_id and "test" in r.evaluations
    }
    first = next((o.run_id for o in openings if o.run_id in tests), None)
    test = tests[first].evaluations["test"] if first else None
    return TestFigure(
        name=chosen.label,
        run_id=run_id,
        metric=metric,
        eval_run=first,
        n=test.n if test else None,
        value=test.metrics.get(metric) if test else None,
        openings=len(openings),
        validation=chosen.primary.variant,
    )


def _shown(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def final_test(
    compare: Compare, runs: Sequence[RunEvidence], openings: Sequence[SealedOpening]
) -> str | None:
    """The adopted variant's primary metric on the sealed test split as a sentence (None when
    no variant is adopted); see `test_figure`."""
    t = test_figure(compare, runs, openings)
    if t is None:
        return None
    if t.eval_run is None:
        return (
            f"{t.name} is not yet evaluated on the sealed test split: "
            f"`tunelab eval {t.run_id} --split test --final` opens it, once."
        )
    times = (
        "its only opening"
        if t.openings == 1
        else f"opened {t.openings} times in all: no longer an untouched control"
    )
    return (
        f"On the sealed test split ({t.n} examples, eval run {t.eval_run}, {times}): "
        f"{t.name} {t.metric} {_shown(t.value)} (validation {t.validation:.4f})."
    )
