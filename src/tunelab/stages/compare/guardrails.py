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

from tunelab.core.config import GuardrailRule

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
    """One verdict per rule and scope item: {rule, metric, scope, item, op, value, baseline,
    bound, pass, note}. A metric the run lacks, a relative rule without a baseline value, or a
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
                    "pass": bool(passed),
                    "note": note,
                }
            )
    return out


def all_pass(verdicts: Sequence[Mapping[str, Any]]) -> bool:
    return all(v["pass"] for v in verdicts)
