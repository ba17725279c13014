"""Two evaluations side by side (pure: values in, values out): per-example tables
(`example_stats`), paired statistics, guardrails judged and the decision
(`compare_evaluations(..., fields=, paths=)`). The statistics themselves (paired bootstrap,
McNemar, bounds, Holm, TOST) live in `tunelab.lib.statistics`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tunelab.core.config_sections import CLASSIFYING_KINDS
from tunelab.core.record_checks import ExampleVerdicts
from tunelab.core.record_parts import Delta, Primary
from tunelab.core.run_parts import Prediction
from tunelab.lib.statistics import (
    Stat,
    f1_stats,
    mcnemar,
    mean_stat,
    paired_draws,
    ratio_stat,
    summarize_draws,
)
from tunelab.stages.compare.diffs import flips, flips_by_category
from tunelab.stages.compare.guardrails import (
    as_verdicts,
    check_guardrails,
    inner_metrics,
    judge_guardrails,
    overall_verdict,
)
from tunelab.stages.compare.verdicts import (
    DecisionTests,
    estimates,
    primary_verdict,
    run_decision,
    value_pairs,
)

# ---------------------------------------------------------------- per-example tables


def example_stats(
    kind: str,
    rows: Sequence[Mapping[str, Any] | Prediction],
    labels: Sequence[str],
    fields: Sequence[str],
    paths: Sequence[str] = (),
) -> tuple[dict[str, Stat], dict[str, Stat], dict[str, Stat]]:
    """Bootstrap statistics of one evaluation from its prediction rows (in pairing order).

    Returns (overall {metric: stat [B]}, per_category {"f1": stat [B, C]}, per_field
    {metric: stat [B, P]} over `paths`, the extraction schema's paths, default `fields`).
    """
    overall: dict[str, Stat] = {}
    per_category: dict[str, Stat] = {}
    per_field: dict[str, Stat] = {}
    rows = Prediction.rows(rows, "the predictions")
    correct = [bool(r.correct) for r in rows]
    if kind == "classification":
        f1 = f1_stats([r.gold for r in rows], [r.prediction for r in rows], labels)
        overall["accuracy"] = mean_stat(correct)
        overall["macro_f1"] = f1["macro_f1"]
        overall["weighted_f1"] = f1["weighted_f1"]
        for key in CATEGORY_KEYS:
            per_category[key] = f1[f"per_category_{key}"]
        return overall, per_category, per_field
    verdicts = [
        ExampleVerdicts.of("the predictions", r.verdicts or {}, f"[{i}].verdicts")
        for i, r in enumerate(rows)
    ]
    if kind == "format":
        for key, metric in (
            ("format_valid", "format_valid_rate"),
            ("json_valid", "json_valid_rate"),
            ("schema_valid", "schema_valid_rate"),
            ("exact_match", "exact_match"),
        ):
            # the format task's verdicts by name, as its scorer wrote them
            if rows and all(v.raw.get(key) is not None for v in verdicts):
                overall[metric] = mean_stat([bool(v.raw[key]) for v in verdicts])
        return overall, per_category, per_field
    overall |= _extraction_stats(verdicts, list(fields), list(paths or fields), per_field)
    return overall, per_category, per_field


def _extraction_stats(
    verdicts: list[ExampleVerdicts],
    fields: list[str],
    paths: list[str],
    per_field: dict[str, Stat],
) -> dict[str, Stat]:
    """Extraction's statistics from the per-path counts of each example (see
    metrics.extraction_metrics): fills `per_field` ([B, P]) and returns the overall ones."""
    keys = ("slots", "present", "empty_match", "exact", "match", "tp", "pred", "gold")
    counts = {  # key -> [n, P]
        key: np.array(
            [[v.path_count(p, key) for p in paths] for v in verdicts],
            dtype=np.float64,
        ).reshape(len(verdicts), len(paths))
        for key in keys
    }
    answered = counts["present"] + counts["empty_match"]  # as metrics' presence_rate
    rates = {"presence_rate": answered, "exact_match": counts["exact"]}
    rates["normalized_match"] = counts["match"]
    for name, numerator in rates.items():
        per_field[name] = ratio_stat(numerator, counts["slots"])
    per_field["f1"] = ratio_stat(2 * counts["tp"], counts["pred"] + counts["gold"])
    top = [paths.index(f) for f in fields if f in paths]
    overall: dict[str, Stat] = {
        "json_valid_rate": mean_stat([bool(v.json_valid) for v in verdicts]),
        "schema_valid_rate": mean_stat([bool(v.schema_valid) for v in verdicts]),
    }
    for name in rates:
        stat = per_field[name]
        overall[f"field_{name}"] = lambda w, stat=stat: stat(w)[:, top].mean(axis=1)
    overall["field_micro_f1"] = ratio_stat(
        2 * counts["tp"][:, top].sum(axis=1),
        (counts["pred"] + counts["gold"])[:, top].sum(axis=1),
    )
    overall["exact_match"] = mean_stat([bool(v.exact_match) for v in verdicts])
    overall["all_fields_match_rate"] = mean_stat([bool(v.all_fields_match) for v in verdicts])
    return overall


def compare_evaluations(
    kind: str,
    baseline_rows: Sequence[Mapping[str, Any]],
    variant_rows: Sequence[Mapping[str, Any]],
    *,
    baseline_metrics: Mapping[str, Any],
    variant_metrics: Mapping[str, Any],
    guardrails: Sequence[Any],
    primary_metric: str,
    min_improvement: float = 0.0,
    labels: Sequence[str] = (),
    fields: Sequence[str] = (),
    paths: Sequence[str] = (),
    samples: int = 1000,
    seed: int = 0,
    tests: DecisionTests | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """Everything one comparison row holds, computed from two evaluations' records (`note`:
    one more note for the row, after the pairing's).

    Examples are paired by id (those in both); the notes say how many were left unpaired.
    `paths`: an extraction schema's paths (default `fields`), each with paired intervals.
    `tests`: the locked confidence, interval method, multiplicity and goal (default: the
    documented defaults). The row's `decision` is adopt, reject or inconclusive (see
    `tunelab.stages.compare.verdicts`).
    """
    ids, base, var, notes = _paired(
        Prediction.rows(baseline_rows, "the baseline's predictions"),
        Prediction.rows(variant_rows, "the variant's predictions"),
    )
    notes += [note] if note else []
    paths = list(paths or fields)
    pairs = _stat_pairs(kind, base, var, labels, fields, paths)
    tests = tests or DecisionTests()
    point, draws = paired_draws(
        pairs | value_pairs(guardrails, pairs), len(ids), samples=samples, seed=seed
    )
    boot = summarize_draws({k: point[k] for k in pairs}, draws, tests.confidence)

    metrics = {m: r for m, r in boot.items() if "." not in m}
    b_inner, v_inner = inner_metrics(baseline_metrics), inner_metrics(variant_metrics)
    if primary_metric not in metrics and primary_metric in v_inner:
        metrics[primary_metric] = _unpaired_metric(primary_metric, b_inner, v_inner)
    per_category = _per_item(boot, "per_category", labels, b_inner, v_inner, CATEGORY_KEYS)
    per_field = _per_item(boot, "per_field", paths, b_inner, v_inner, FIELD_KEYS)
    estimate_of = estimates(point, draws, labels=labels, paths=paths, n=len(ids), tests=tests)
    primary = _primary(metrics, primary_metric, min_improvement, estimate_of, tests, len(ids))
    verdicts = judge_guardrails(
        check_guardrails(guardrails, baseline_metrics, variant_metrics),
        estimate_of,
        n=len(ids),
        confidence=tests.confidence,
        multiplicity=tests.multiplicity,
    )
    judged = as_verdicts(verdicts)
    guards = overall_verdict(judged)
    decision, reasons = run_decision(
        Primary.of("the comparison", primary, "primary"), judged, guards
    )
    changed, changes_test = _flips(kind, ids, base, var, labels)
    return {
        "n_paired": len(ids),
        "notes": notes,
        "primary": primary,
        "metrics": metrics,
        "mcnemar": changes_test,
        "per_category": per_category,
        "per_field": per_field,
        "guardrails": verdicts,
        "guardrails_pass": all(v.passed for v in judged),
        "guardrails_verdict": guards,
        "decision": decision,
        "decision_reasons": reasons,
        "flips": changed,
    }


def _stat_pairs(
    kind: str, base: Sequence[Prediction], var: Sequence[Prediction], labels: Sequence[str],
    fields: Sequence[str], paths: Sequence[str],
) -> dict[str, tuple[Any, Any]]:  # fmt: skip
    """{statistic: (the baseline's, the variant's)} per example, overall, per category and per
    field, for the paired bootstrap."""
    b_overall, b_cat, b_field = example_stats(kind, base, labels, fields, paths)
    v_overall, v_cat, v_field = example_stats(kind, var, labels, fields, paths)
    pairs = {m: (b_overall[m], v_overall[m]) for m in b_overall if m in v_overall}
    pairs |= {f"per_category.{m}": (b_cat[m], v_cat[m]) for m in b_cat}
    return pairs | {f"per_field.{m}": (b_field[m], v_field[m]) for m in b_field}


def _flips(
    kind: str, ids: Sequence[str], base: Sequence[Prediction], var: Sequence[Prediction],
    labels: Sequence[str],
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The paired examples that flipped (by category for a classifier) and McNemar's test."""
    base_ok = [bool(r.correct) for r in base]
    var_ok = [bool(r.correct) for r in var]
    changed = flips(ids, base_ok, var_ok)
    if kind in CLASSIFYING_KINDS:
        changed["by_category"] = flips_by_category(base, base_ok, var_ok, labels)
    return changed, mcnemar(base_ok, var_ok)


def _primary(
    metrics: Mapping[str, Any],
    name: str,
    min_improvement: float,
    estimate_of: Any,
    tests: DecisionTests,
    n: int,
) -> dict[str, Any]:
    """The primary metric's row: its interval, whether it meets the smallest improvement that
    counts, and its verdict under the locked tests."""
    primary = dict(metrics.get(name) or {})
    row = Delta.of("the comparison", primary, "primary")
    primary.update(
        metric=name,
        min_improvement=min_improvement,
        meets_min_improvement=None if row.delta is None else row.delta >= min_improvement,
        significant=None if row.ci_low is None else row.ci_low > 0,
    )
    estimate = estimate_of(name, "overall", None, True)
    return primary | primary_verdict(primary, estimate, tests, min_improvement, n)


def _paired(
    baseline_rows: Sequence[Prediction], variant_rows: Sequence[Prediction]
) -> tuple[list[Any], list[Prediction], list[Prediction], list[str]]:
    """The ids in both, the two rows of each in that order, and a note of the unpaired."""
    base_by_id = {r.id: r for r in baseline_rows}
    var_by_id = {r.id: r for r in variant_rows}
    ids = [i for i in base_by_id if i in var_by_id]
    notes = []
    only_base, only_var = len(base_by_id) - len(ids), len(var_by_id) - len(ids)
    if only_base or only_var:
        notes.append(
            f"paired over {len(ids)} shared examples ({only_base} only in the baseline, "
            f"{only_var} only in the variant)"
        )
    return ids, [base_by_id[i] for i in ids], [var_by_id[i] for i in ids], notes


def _unpaired_metric(
    name: str, b_inner: Mapping[str, Any], v_inner: Mapping[str, Any]
) -> dict[str, Any]:
    """A metric the records hold but the examples cannot resample: its values, no interval."""
    bv, vv = b_inner.get(name), v_inner.get(name)
    delta = None if bv is None or vv is None else vv - bv
    return {"baseline": bv, "variant": vv, "delta": delta, "ci_low": None, "ci_high": None}


CATEGORY_KEYS = ("precision", "recall", "f1")
FIELD_KEYS = ("presence_rate", "exact_match", "normalized_match", "f1")


def _per_item(
    boot: Mapping[str, Mapping[str, Any]],
    table: str,
    items: Sequence[str],
    base: Mapping[str, Any],
    var: Mapping[str, Any],
    keys: Sequence[str],
) -> dict[str, dict[str, dict[str, Any]]]:
    """{item: {metric: {baseline, variant, delta, ci_low, ci_high}}}: the recorded values, with
    bootstrap intervals where the metric was resampled."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    b_table, v_table = base.get(table) or {}, var.get(table) or {}
    for j, item in enumerate(items):
        row = {}
        for key in keys:
            bv = (b_table.get(item) or {}).get(key)
            vv = (v_table.get(item) or {}).get(key)
            entry = {
                "baseline": bv,
                "variant": vv,
                "delta": None if bv is None or vv is None else vv - bv,
                "ci_low": None,
                "ci_high": None,
            }
            sampled = boot.get(f"{table}.{key}")
            if sampled is not None:
                entry["ci_low"] = sampled["ci_low"][j]
                entry["ci_high"] = sampled["ci_high"][j]
            row[key] = entry
        out[item] = row
    return out
