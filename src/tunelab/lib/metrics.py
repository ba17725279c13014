"""The metric suite: values in, values out (no model, no disk).

Classification: per-category precision, recall, F1 and support, macro and weighted F1, accuracy
and the confusion matrix (scikit-learn's definitions, `zero_division=0`).
Format: validity rate and counts per failure kind.
Extraction: parse rate (`json_valid_rate`), schema-valid rate, and per path of the schema:
presence rate, exact match, normalized match (by the scoring rules of
`tunelab.lib.tasks.schema_scoring`), precision/recall/F1 and failures by kind; their averages over
the top-level fields and the field micro-F1.

Per-example verdicts (`ExtractionTask.verdicts`: counts per path) are what the aggregates are
built from, so that the comparison can resample examples and recompute every metric the same
way.

`classification_metrics`, `format_metrics`, `extraction_metrics(verdicts, fields, paths)`;
`OVERALL_METRICS[kind]` is also the order in which `tunelab eval` prints the overall metrics;
`study_metric_problems(cfg)`: a primary or guardrail metric the task never records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tunelab.lib.tasks.schema_scoring import SCORING_VERSION, SLOT_FAILURES

# Metric names that guardrails and the hypothesis may name, by scope.
OVERALL_METRICS = {
    "classification": (
        "accuracy",
        "macro_f1",
        "weighted_f1",
        "macro_precision",
        "macro_recall",
    ),
    "format": ("format_valid_rate", "json_valid_rate", "schema_valid_rate", "exact_match"),
    "extraction": (
        "json_valid_rate",
        "schema_valid_rate",
        "field_presence_rate",
        "field_exact_match",
        "field_normalized_match",
        "field_micro_precision",
        "field_micro_recall",
        "field_micro_f1",
        "exact_match",
        "all_fields_match_rate",
    ),
}
CATEGORY_METRICS = ("precision", "recall", "f1", "support")
# per path of an extraction schema (top-level fields, `address.city`, `quantities`,
# `quantities[].unit`): the guardrail scope every_field covers each one
FIELD_METRICS = (
    "presence_rate",
    "exact_match",
    "normalized_match",
    "precision",
    "recall",
    "f1",
    "support",
    "slots",
)
NO_PREDICTION = "(none)"
_SCOPE_NAMES = {"every_category": "per-category", "every_field": "per-field"}


def known_metrics(kind: str, scope: str, *, regex: bool = False) -> tuple[str, ...]:
    """The names an evaluation of a `kind` task records in `scope`, which the hypothesis and the
    guardrails may name (empty: the kind has no items of that scope). `regex`: a format task
    given task.regex, which has no JSON to parse (no json_valid_rate, schema_valid_rate)."""
    scored_as = "classification" if kind == "image_classification" else kind
    if scope == "overall":
        names = OVERALL_METRICS.get(scored_as, ())
        if kind == "format" and regex:
            names = tuple(n for n in names if n not in ("json_valid_rate", "schema_valid_rate"))
        return names
    if scope == "every_category" and scored_as == "classification":
        return CATEGORY_METRICS + tuple(f"category_{m}" for m in CATEGORY_METRICS)
    if scope == "every_field" and kind == "extraction":
        return FIELD_METRICS + tuple(f"field_{m}" for m in FIELD_METRICS)
    return ()


def study_metric_problems(cfg: Any) -> list[str]:
    """`metric_problems` of a StudyConfig's hypothesis and guardrails (`tunelab validate`,
    `tunelab register`)."""
    return metric_problems(
        cfg.task.kind,
        cfg.hypothesis.primary_metric,
        [(rule.metric, rule.scope) for rule in cfg.guardrails],
        regex=cfg.task.regex is not None,
    )


def metric_problems(
    kind: str, primary: str, rules: Sequence[tuple[str, str]], *, regex: bool = False
) -> list[str]:
    """`field: why` for each name the hypothesis (`primary`) or a guardrail ((metric, scope)
    per rule) gives that no evaluation of the task records: it could never be checked."""
    from difflib import get_close_matches

    what = f"a {kind} task" + (" with task.regex" if kind == "format" and regex else "")

    def unknown(field: str, name: str, names: tuple[str, ...], where: str) -> str:
        close = get_close_matches(name, names, n=1, cutoff=0.8)
        guess = f"did you mean {close[0]}? " if close else ""
        return (
            f"{field}: {name!r} is not {where}metric of {what} ({guess}one of: {', '.join(names)})"
        )

    out = []
    overall = known_metrics(kind, "overall", regex=regex)
    if primary not in overall:
        out.append(unknown("hypothesis.primary_metric", primary, overall, "an overall "))
    for i, (metric, scope) in enumerate(rules):
        names = known_metrics(kind, scope, regex=regex)
        if not names:
            scopes = [s for s in ("overall", *_SCOPE_NAMES) if known_metrics(kind, s)]
            out.append(
                f"guardrails[{i}].scope: {what} has no {_SCOPE_NAMES[scope]} metrics "
                f"(scope: {' or '.join(scopes)})"
            )
        elif metric not in names:
            where = f"a {_SCOPE_NAMES[scope]} " if scope in _SCOPE_NAMES else "an overall "
            out.append(unknown(f"guardrails[{i}].metric", metric, names, where))
    return out


def _div(a: float, b: float) -> float:
    return float(a) / float(b) if b else 0.0


def _f1(p: float, r: float) -> float:
    return _div(2 * p * r, p + r)


# ---------------------------------------------------------------- classification


def classification_metrics(
    golds: Sequence[str], preds: Sequence[str | None], labels: Sequence[str]
) -> dict[str, Any]:
    """Per-category and averaged scores over `labels` (the order of the confusion matrix).

    A prediction outside `labels` (or None) is wrong for every category and gets its own
    confusion column `(none)`. Macro averages are over `labels`, weighted by gold support for
    the weighted ones, as scikit-learn's `precision_recall_fscore_support(labels=labels,
    zero_division=0)`.

    Returns {accuracy, macro_precision, macro_recall, macro_f1, weighted_f1, n, per_category:
    {label: {precision, recall, f1, support}}, confusion: {labels, predicted, matrix}}; matrix
    rows are gold labels, columns predicted labels.
    """
    if len(golds) != len(preds):
        raise ValueError(f"{len(golds)} gold labels but {len(preds)} predictions")
    labels = list(labels)
    index = {label: i for i, label in enumerate(labels)}
    columns = list(labels)
    if any(p not in index for p in preds):
        columns.append(NO_PREDICTION)
    col_index = {c: j for j, c in enumerate(columns)}
    matrix = [[0] * len(columns) for _ in labels]
    extra_gold: Counter[str] = Counter()
    for g, p in zip(golds, preds, strict=True):
        if g not in index:
            extra_gold[g] += 1
            continue
        matrix[index[g]][col_index.get(p, col_index.get(NO_PREDICTION, -1))] += 1
    if extra_gold:
        raise ValueError(f"gold labels outside the label set: {dict(extra_gold)}")

    per_category: dict[str, dict[str, float]] = {}
    total_support = 0
    for i, label in enumerate(labels):
        tp = matrix[i][i]
        support = sum(matrix[i])
        predicted = sum(row[i] for row in matrix)
        precision, recall = _div(tp, predicted), _div(tp, support)
        per_category[label] = {
            "precision": precision,
            "recall": recall,
            "f1": _f1(precision, recall),
            "support": support,
        }
        total_support += support
    n_labels = len(labels)
    correct = sum(1 for g, p in zip(golds, preds, strict=True) if g == p)
    cats = per_category.values()
    return {
        "n": len(golds),
        "accuracy": _div(correct, len(golds)),
        "macro_precision": _div(sum(c["precision"] for c in cats), n_labels),
        "macro_recall": _div(sum(c["recall"] for c in cats), n_labels),
        "macro_f1": _div(sum(c["f1"] for c in cats), n_labels),
        "weighted_f1": _div(sum(c["f1"] * c["support"] for c in cats), total_support),
        "per_category": per_category,
        "confusion": {"labels": labels, "predicted": columns, "matrix": matrix},
    }


# ---------------------------------------------------------------- format


def failure_kind(verdicts: Mapping[str, Any]) -> str | None:
    """The kind an output failed in, as `failure_counts` counts it: an extraction's JSON reader
    kind (`json_failure`: no_json, truncated, ...) where it has one, else the task's `failure`."""
    return verdicts.get("json_failure") or verdicts.get("failure")


def format_metrics(
    valid: Sequence[bool],
    failures: Sequence[str | None],
    json_valid: Sequence[bool] | None = None,
    schema_valid: Sequence[bool] | None = None,
    exact: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """Validity rate and how many outputs failed in each way (`failure_counts`).

    `json_valid` and `schema_valid` (per example) add `json_valid_rate` and `schema_valid_rate`
    when the format is a JSON schema; `exact` adds `exact_match` (the answer equals the target).
    """
    n = len(valid)
    out: dict[str, Any] = {
        "n": n,
        "format_valid_rate": _div(sum(map(bool, valid)), n),
        "failure_counts": dict(sorted(Counter(f for f in failures if f).items())),
    }
    if exact is not None:
        out["exact_match"] = _div(sum(map(bool, exact)), n)
    if json_valid is not None:
        out["json_valid_rate"] = _div(sum(map(bool, json_valid)), n)
    if schema_valid is not None:
        out["schema_valid_rate"] = _div(sum(map(bool, schema_valid)), n)
    return out


# ---------------------------------------------------------------- extraction


def _path_row(kind: str, sums: Mapping[str, int]) -> dict[str, Any]:
    slots = sums.get("slots", 0)
    tp, pred, gold = sums.get("tp", 0), sums.get("pred", 0), sums.get("gold", 0)
    precision, recall = _div(tp, pred), _div(tp, gold)
    return {
        "kind": kind,
        "slots": slots,
        # a field answered: a present value, or the null / [] an empty gold asks for
        "presence_rate": _div(sums.get("present", 0) + sums.get("empty_match", 0), slots),
        "exact_match": _div(sums.get("exact", 0), slots),
        "normalized_match": _div(sums.get("match", 0), slots),
        "precision": precision,
        "recall": recall,
        "f1": _div(2 * tp, pred + gold),
        "support": gold,
        "failures": {k: sums.get(k, 0) for k in SLOT_FAILURES},
    }


def extraction_metrics(
    verdicts: Sequence[Mapping[str, Any]],
    fields: Sequence[str],
    paths: Sequence[Mapping[str, str]] = (),
) -> dict[str, Any]:
    """Aggregate per-example extraction verdicts (`ExtractionTask.verdicts`).

    `per_field` has one row per path (`paths`: the schema's [{path, kind}], top-level fields
    first; paths only the verdicts name are added after): its rates are sums over examples of
    the path's counts divided by its slots (`normalized_match` is the share of slots that
    match by the scoring rules), precision / recall / F1 from its tp, pred and gold (items for
    a list path), `support` its gold count, `failures` its slots per failure kind.
    Overall `field_*` rates are unweighted means over the top-level `fields`;
    `field_micro_*` pool tp, pred and gold over them; `exact_match` / `all_fields_match_rate`:
    examples whose every top-level field is exact / matches. `failure_counts`: examples per
    parse failure kind (the JSON reader's kind, else `schema_error`).
    """
    n = len(verdicts)
    kinds = {p["path"]: p["kind"] for p in paths}
    sums: dict[str, Counter[str]] = {p: Counter() for p in kinds}
    for v in verdicts:
        for path, counts in (v.get("paths") or {}).items():
            sums.setdefault(path, Counter()).update(counts)
    per_field = {p: _path_row(kinds.get(p, "value"), c) for p, c in sums.items()}
    top = [per_field.get(f) or _path_row("value", {}) for f in fields]
    tp = sum(sums.get(f, Counter())["tp"] for f in fields)
    n_pred = sum(sums.get(f, Counter())["pred"] for f in fields)
    n_gold = sum(sums.get(f, Counter())["gold"] for f in fields)
    k = len(fields)
    failures = Counter(failure_kind(v) for v in verdicts)
    failures.pop(None, None)
    return {
        "n": n,
        "scoring": SCORING_VERSION,
        "json_valid_rate": _div(sum(bool(v.get("json_valid")) for v in verdicts), n),
        "schema_valid_rate": _div(sum(bool(v.get("schema_valid")) for v in verdicts), n),
        "field_presence_rate": _div(sum(m["presence_rate"] for m in top), k),
        "field_exact_match": _div(sum(m["exact_match"] for m in top), k),
        "field_normalized_match": _div(sum(m["normalized_match"] for m in top), k),
        "field_micro_precision": _div(tp, n_pred),
        "field_micro_recall": _div(tp, n_gold),
        "field_micro_f1": _div(2 * tp, n_pred + n_gold),
        "exact_match": _div(sum(bool(v.get("exact_match")) for v in verdicts), n),
        "all_fields_match_rate": _div(sum(bool(v.get("all_fields_match")) for v in verdicts), n),
        "failure_counts": dict(sorted(failures.items())),
        "per_field": per_field,
    }
