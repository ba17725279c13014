"""The metric suite: values in, values out (no model, no disk).

Classification: per-category precision, recall, F1 and support, macro and weighted F1, accuracy
and the confusion matrix (scikit-learn's definitions, `zero_division=0`).
Format: validity rate and counts per failure kind.
Extraction: parse rate (`json_valid_rate`), schema-valid rate, and per required field: presence
rate, exact match, normalized match, precision/recall/F1; their averages over fields and the
field micro-F1.

Per-example verdicts (`field_verdicts`) are what the aggregates are built from, so that the
comparison can resample examples and recompute every metric the same way.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

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
FIELD_METRICS = (
    "presence_rate",
    "exact_match",
    "normalized_match",
    "precision",
    "recall",
    "f1",
    "support",
)
NO_PREDICTION = "(none)"


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


def normalize_value(value: Any) -> str | None:
    """The comparable form of a field value: NFKC, case-folded, whitespace collapsed, and
    surrounding quotes, angle brackets and trailing punctuation removed. Numbers and booleans
    compare by their text ("5" matches 5); lists and objects by canonical JSON. None and the
    empty string are "absent" (None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = repr(value)
        if isinstance(value, float) and value.is_integer():
            text = str(int(value))
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    text = text.strip(" \"'`<>").rstrip(".,;:")
    return text or None


def is_present(value: Any) -> bool:
    """A field counts as present unless it is missing, None, a blank string, [] or {}."""
    if value is None:
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, dict)):
        return bool(value)
    return True


def field_verdicts(
    prediction: Mapping[str, Any] | None, gold: Mapping[str, Any], fields: Sequence[str]
) -> dict[str, Any]:
    """Per-field verdicts of one example.

    `prediction` is the parsed object (None when the output did not parse or is not an object).
    Returns {"presence": {field: bool}, "gold_present": {...}, "exact": {...}, "normalized":
    {...}, "tp", "n_pred", "n_gold"}, where a true positive is a present predicted value whose normalized form equals a
    present gold value; n_pred / n_gold count present predicted / gold values.
    """
    pred = prediction if isinstance(prediction, Mapping) else {}
    presence, gold_present, exact, normalized = {}, {}, {}, {}
    tp = n_pred = n_gold = 0
    for f in fields:
        p, g = pred.get(f), gold.get(f)
        p_in, g_in = is_present(p), is_present(g)
        presence[f] = p_in
        gold_present[f] = g_in
        exact[f] = (p == g) if (p_in and g_in) else (not p_in and not g_in)
        same = normalize_value(p) == normalize_value(g)
        normalized[f] = same
        n_pred += p_in
        n_gold += g_in
        tp += p_in and g_in and same
    return {
        "presence": presence,
        "gold_present": gold_present,
        "exact": exact,
        "normalized": normalized,
        "tp": tp,
        "n_pred": n_pred,
        "n_gold": n_gold,
    }


def extraction_metrics(
    json_valid: Sequence[bool],
    schema_valid: Sequence[bool],
    verdicts: Sequence[Mapping[str, Any]],
    fields: Sequence[str],
) -> dict[str, Any]:
    """Aggregate per-example extraction verdicts (from `field_verdicts`).

    Rates are over all examples (an output that did not parse has every field absent).
    `field_*` overall metrics are the unweighted means over fields of the per-field rates;
    `field_micro_f1` pools true positives, predicted and gold values over every field.
    `exact_match`: examples whose every field equals the gold value exactly;
    `all_fields_match_rate`: the same after normalization.
    """
    n = len(verdicts)
    per_field: dict[str, dict[str, float]] = {}
    for f in fields:
        present = sum(v["presence"][f] for v in verdicts)
        tp = sum(v["presence"][f] and v["gold_present"][f] and v["normalized"][f] for v in verdicts)
        n_pred = present
        n_gold = sum(v["gold_present"][f] for v in verdicts)
        precision, recall = _div(tp, n_pred), _div(tp, n_gold)
        per_field[f] = {
            "presence_rate": _div(present, n),
            "exact_match": _div(sum(v["exact"][f] for v in verdicts), n),
            "normalized_match": _div(sum(v["normalized"][f] for v in verdicts), n),
            "precision": precision,
            "recall": recall,
            "f1": _f1(precision, recall),
            "support": n_gold,
        }
    tp = sum(v["tp"] for v in verdicts)
    n_pred = sum(v["n_pred"] for v in verdicts)
    n_gold = sum(v["n_gold"] for v in verdicts)
    k = len(fields)
    return {
        "n": n,
        "json_valid_rate": _div(sum(map(bool, json_valid)), n),
        "schema_valid_rate": _div(sum(map(bool, schema_valid)), n),
        "field_presence_rate": _div(sum(m["presence_rate"] for m in per_field.values()), k),
        "field_exact_match": _div(sum(m["exact_match"] for m in per_field.values()), k),
        "field_normalized_match": _div(sum(m["normalized_match"] for m in per_field.values()), k),
        "field_micro_precision": _div(tp, n_pred),
        "field_micro_recall": _div(tp, n_gold),
        "field_micro_f1": _div(2 * tp, n_pred + n_gold),
        "exact_match": _div(sum(all(v["exact"][f] for f in fields) for v in verdicts), n),
        "all_fields_match_rate": _div(
            sum(all(v["normalized"][f] for f in fields) for v in verdicts), n
        ),
        "per_field": per_field,
    }
