"""Guardrails: what must not get worse, checked rule by rule against baseline and run metrics.

A rule names a metric, a scope (overall, every category, every field: for an extraction task,
every path of its schema, nested ones such as `quantities[].unit` included), an operator and a value;
with `relative_to: baseline` the bound is the baseline's metric plus the value. Each rule gives
one verdict per item of its scope, with the numbers behind it.

`check_guardrails(rules, baseline_metrics, run_metrics) -> [{rule, metric, scope, item, op,
value, baseline, bound, pass, note}]` (`every_field` covers every extraction path); `all_pass`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tunelab.core.config_sections import GuardrailRule
from tunelab.core.record_parts import GuardrailVerdict
from tunelab.lib.statistics import Estimate, examples_to_settle, step_down

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
# Relative bounds are sums of floats (0.8 - 0.02); a difference below this is equality.
_EPS = 1e-9
_SCOPE_TABLE = {"every_category": "per_category", "every_field": "per_field"}
_SCOPE_PREFIX = {"every_category": "category_", "every_field": "field_"}


def inner_metrics(metrics: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """Accept a metrics record ({"split", ..., "metrics": {...}}) or its inner metrics dict."""
    if metrics is None:
        return {}
    inner = metrics.get("metrics")
    return inner if isinstance(inner, Mapping) else metrics


def lookup(metrics: Mapping[str, Any], metric: str, scope: str) -> dict[str, float | None]:
    """{item: value} of `metric` in `scope` ({None: value} for overall). Per-category and
    per-field names may carry their prefix: `field_presence_rate` is `presence_rate` of a field.
    """
    if scope == "overall":
        value = metrics.get(metric)
        return {None: value if isinstance(value, (int, float)) else None}  # type: ignore[dict-item]
    table = metrics.get(_SCOPE_TABLE[scope]) or {}
    key = metric.removeprefix(_SCOPE_PREFIX[scope])
    out: dict[str, float | None] = {}
    for item, row in table.items():
        value = row.get(metric, row.get(key)) if isinstance(row, Mapping) else None
        out[item] = value if isinstance(value, (int, float)) else None
    return out


# what a scope item's row counts its examples by: a category its gold examples, a field its slots
_ITEM_COUNT = {"every_category": ("support", "examples"), "every_field": ("slots", "slots")}


def _empty_item(metrics: Mapping[str, Any], metric: str, scope: str, item: Any) -> str | None:
    """Why `item` of `scope` has nothing to judge `metric` on (None when it has): a category
    without a gold example in the split, or a field without a slot."""
    if scope not in _ITEM_COUNT or item is None:
        return None
    count_key, what = _ITEM_COUNT[scope]
    row = (metrics.get(_SCOPE_TABLE[scope]) or {}).get(item)
    if metric.removeprefix(_SCOPE_PREFIX[scope]) == count_key or not isinstance(row, Mapping):
        return None
    count = row.get(count_key)
    if isinstance(count, (int, float)) and count == 0:
        return f"{item!r} has no {what} in this split: its {metric} cannot be judged"
    return None


def _compare(value: float, op: str, bound: float) -> bool:
    if op in (">=", "<=") and abs(value - bound) <= _EPS:
        return True
    return _OPS[op](value, bound)


def check_guardrails(
    rules: Sequence[GuardrailRule | Mapping[str, Any]],
    baseline_metrics: Mapping[str, Any] | None,
    run_metrics: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """One verdict per rule and scope item on the point values: {rule, metric, scope, item, op,
    value, baseline, bound, margin, relative_to, test, pass, note}. A metric the run lacks, a relative rule without a baseline value, or a
    category (field) with no example (slot) in the split fails with a note saying so (a
    guardrail that cannot be checked does not pass)."""
    base = inner_metrics(baseline_metrics)
    run = inner_metrics(run_metrics)
    out = []
    for raw in rules:
        rule = raw if isinstance(raw, GuardrailRule) else GuardrailRule.model_validate(raw)
        run_values = lookup(run, rule.metric, rule.scope)
        base_values = lookup(base, rule.metric, rule.scope) if base else {}
        items = list(run_values)
        if rule.relative_to:
            items += [i for i in base_values if i not in run_values]
        if not items:
            items = [None]
        for item in items:
            value = run_values.get(item)
            baseline = base_values.get(item)
            note = None
            bound: float | None = rule.value
            if rule.relative_to:
                bound = None if baseline is None else baseline + rule.value
            empty = _empty_item(run, rule.metric, rule.scope, item)
            if empty is not None:
                note = empty
            elif value is None:
                where = f" for {item!r}" if item is not None else ""
                note = f"the run has no {rule.metric}{where}"
            elif bound is None:
                note = f"the baseline has no {rule.metric}" + (
                    f" for {item!r}" if item is not None else ""
                )
            passed = note is None and _compare(float(value), rule.op, float(bound))  # type: ignore[arg-type]
            out.append(
                {
                    "rule": rule.describe(),
                    "metric": rule.metric,
                    "scope": rule.scope,
                    "item": item,
                    "op": rule.op,
                    "value": value,
                    "baseline": baseline,
                    "bound": bound,
                    "margin": rule.value,
                    "relative_to": rule.relative_to,
                    "test": rule.test,
                    "pass": bool(passed),
                    "note": note,
                }
            )
    return out


# (metric, scope, item, relative) -> the estimate of the run's value or its delta, or None
EstimateOf = Callable[[str, str, Any, bool], Estimate | None]


def judge_guardrails(
    items: Sequence[Mapping[str, Any]],
    estimate_of: EstimateOf,
    *,
    n: int,
    confidence: float = 0.95,
    multiplicity: str = "holm",
) -> list[dict[str, Any]]:
    """The verdicts of `check_guardrails` items: `point` items keep their point verdict;
    `interval` items are judged on bounds (see the module docstring). Each item gains
    `verdict` (pass | fail | inconclusive), `point_pass`, and for interval items `ci_low`,
    `ci_high` (the two-sided interval at `confidence` of the value or the delta judged),
    `judged_bound` (the bound the verdict rests on), `level` (one-sided alpha of the pass
    side), `adjusted_level` (of the fail side) and `settle_n` (the split size that would likely
    settle an inconclusive item; None when it cannot be said)."""
    alpha = (1 - confidence) / 2
    rules = as_verdicts(items)
    out = [{**it, "point_pass": rule.passed} for it, rule in zip(items, rules, strict=True)]
    family: list[tuple[int, Estimate]] = []
    for i, (it, rule) in enumerate(zip(out, rules, strict=True)):
        if rule.test == "point" or rule.note is not None:
            it["verdict"] = "pass" if rule.passed else "fail"
            continue
        est = estimate_of(str(rule.metric), str(rule.scope), rule.item, bool(rule.relative_to))
        if est is None:
            it.update(verdict="inconclusive", note=_NO_INTERVAL.format(**it))
            it["pass"] = False
            continue
        family.append((i, est))
    higher = [rules[i].op in (">=", ">") for i, _ in family]
    margins = [float(rules[i].margin or 0.0) for i, _ in family]
    p_fail = [
        est.p_below(m) if up else est.p_above(m)
        for (_, est), m, up in zip(family, margins, higher, strict=True)
    ]

    def fails(j: int, level: float) -> bool:
        est, m = family[j][1], margins[j]
        return est.upper(level) < m - _EPS if higher[j] else est.lower(level) > m + _EPS

    tested = step_down(p_fail, alpha, fails, multiplicity)
    for j, ((i, est), (failed, level)) in enumerate(zip(family, tested, strict=True)):
        _judge_item(out[i], est, margins[j], higher[j], alpha, failed, level, n)
    return out


_NO_INTERVAL = (
    "no interval is resampled for {metric} ({scope}): it cannot be judged on a bound; "
    "write `test: point` on the rule to judge its point estimate"
)


def _judge_item(
    it: dict[str, Any],
    est: Estimate,
    margin: float,
    higher: bool,
    alpha: float,
    failed: bool,
    level: float,
    n: int,
) -> None:
    low, high = est.lower(alpha), est.upper(alpha)
    pass_bound = low if higher else high
    passed = pass_bound >= margin - _EPS if higher else pass_bound <= margin + _EPS
    fail_bound = est.upper(level) if higher else est.lower(level)
    verdict = "pass" if passed else ("fail" if failed else "inconclusive")
    settle = None
    if verdict == "inconclusive":
        settle = examples_to_settle(n, (high - low) / 2, abs(est.point - margin))
    it.update(
        verdict=verdict,
        ci_low=low,
        ci_high=high,
        judged_bound=fail_bound if verdict == "fail" else pass_bound,
        level=alpha,
        adjusted_level=level,
        settle_n=settle,
    )
    it["pass"] = verdict == "pass"


def as_verdicts(items: Sequence[Mapping[str, Any] | GuardrailVerdict]) -> list[GuardrailVerdict]:
    """Guardrail items as `check_guardrails` or `judge_guardrails` made them, typed."""
    return [
        it
        if isinstance(it, GuardrailVerdict)
        else GuardrailVerdict.of("the comparison", it, f"guardrails[{i}]")
        for i, it in enumerate(items)
    ]


def overall_verdict(verdicts: Sequence[Mapping[str, Any] | GuardrailVerdict]) -> str:
    """fail when any item fails, pass when every item passes, else inconclusive."""
    found = {v.outcome for v in as_verdicts(verdicts)}
    if "fail" in found:
        return "fail"
    return "inconclusive" if "inconclusive" in found else "pass"


def all_pass(verdicts: Sequence[Mapping[str, Any] | GuardrailVerdict]) -> bool:
    return all(v.passed for v in as_verdicts(verdicts))
