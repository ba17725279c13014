"""Power at registration: the smallest effect the validation split can detect.

For the primary metric, at the registered level and 80 % power: detectable effect =
(z[1 - alpha] + z[0.8]) x sqrt(2) x SE, where SE is the bootstrap standard error of the metric
on the validation split and sqrt(2) pairs two evaluations whose errors are independent (a
cautious figure: variants that err on the same examples as the baseline detect smaller
effects). SE comes from the baseline's predictions when they exist, else from a stand-in
baseline with the split's size and class balance that gets half of each class right. The split
is the data snapshot's validation split, else the source data cut by `data.splits.validation`.
The same is said of each per-category guardrail margin.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.config_sections import CLASSIFYING_KINDS
from tunelab.lib.statistics import (
    bootstrap_se,
    detectable_effect,
    examples_needed,
    f1_stats,
    paired_se,
    synthetic_predictions,
)

POWER = 0.8
STAND_IN_ACCURACY = 0.5
_SAMPLES = 400


def _split_labels(study: Any, cfg: StudyConfig) -> tuple[list[str | None], str] | None:
    """The validation split's labels (one per example) and where they come from."""
    from tunelab.stages.data.snapshot import list_snapshots, load_snapshot

    if list_snapshots(study):
        snap = load_snapshot(study)
        return [r.get("label") for r in snap.rows("validation")], f"data snapshot {snap.id}"
    from tunelab.stages.data.hub import source_root
    from tunelab.stages.data.readers import read_source

    rows = read_source(source_root(study), cfg.data).rows
    # the snapshot keeps at most data.max_examples rows, the classes in their proportions
    share = cfg.data.splits.validation * min(1.0, (cfg.data.max_examples or len(rows)) / len(rows))
    counts = Counter(r.label for r in rows)
    labels: list[str | None] = []
    for label, count in sorted(counts.items(), key=lambda kv: str(kv[0])):
        labels += [label] * round(count * share)
    return labels, "the source data cut as data.splits and data.max_examples say (no snapshot yet)"


def _baseline_rows(study: Any) -> list[dict[str, Any]] | None:
    from tunelab.core.evidence import latest_baseline
    from tunelab.stages.evaluate.stage import load_predictions

    found = latest_baseline(study, "validation")
    return load_predictions(found[1]) if found else None


def registration_power(study: Any, cfg: StudyConfig) -> dict[str, Any]:
    """{detectable_effect, metric, n, source, level, power, per_category, warnings, note}:
    what the validation split can detect; never raises for missing data (the note says why
    nothing could be said). The warnings about point guardrails are given in every case."""
    out = _estimate(study, cfg)
    return out | {"warnings": power_warnings(cfg, out)}


def _estimate(study: Any, cfg: StudyConfig) -> dict[str, Any]:
    alpha = (1 - cfg.evaluation.confidence) / 2
    metric = cfg.hypothesis.primary_metric
    out: dict[str, Any] = {"metric": metric, "level": alpha, "power": POWER}
    out |= {"detectable_effect": None, "per_category": {}, "n": None, "note": None}
    try:
        rows = _baseline_rows(study)
        found = _split_labels(study, cfg) if rows is None else None
    except Exception as err:  # noqa: BLE001 - power is advice: a data problem is `data`'s to report
        return out | {"note": f"the validation split could not be read ({err})"}
    if rows is not None:
        golds, preds = [r.get("gold") for r in rows], [r.get("prediction") for r in rows]
        out["source"] = "the baseline's predictions"
    else:
        labels, out["source"] = found
        classes = sorted({str(x) for x in labels})
        counts = [sum(1 for x in labels if str(x) == c) for c in classes]
        g, p = synthetic_predictions(counts, STAND_IN_ACCURACY)
        golds, preds = [classes[i] for i in g], [classes[i] for i in p]
        out["source"] += f", a stand-in baseline {STAND_IN_ACCURACY:.0%} right in each class"
    n = len(golds)
    out["n"] = n
    if cfg.task.kind not in CLASSIFYING_KINDS or n == 0:
        return out | {
            "note": "computed for classification tasks only: for format and extraction tasks no figure is given"
        }
    classes = sorted({str(x) for x in golds})
    stats = f1_stats(
        [str(x) for x in golds], [None if x is None else str(x) for x in preds], classes
    )
    stats["accuracy"] = lambda w: (w @ _hits(golds, preds)) / w.sum(axis=1)
    effect = lambda s: detectable_effect(paired_se(s), alpha, POWER)  # noqa: E731
    if metric in stats:
        out["detectable_effect"] = float(effect(bootstrap_se(stats[metric], n, samples=_SAMPLES)))
    per = bootstrap_se(stats["per_category_f1"], n, samples=_SAMPLES)
    support = Counter(str(x) for x in golds)
    out["per_category"] = {
        c: {"n": support[c], "detectable_effect": float(effect(per[j]))}
        for j, c in enumerate(classes)
    }
    return out


def _hits(golds: list[Any], preds: list[Any]) -> Any:
    import numpy as np

    return np.array([float(g == p) for g, p in zip(golds, preds, strict=True)])


def power_warnings(cfg: StudyConfig, power: dict[str, Any]) -> list[str]:
    """min_improvement or a per-category margin below what the split can detect, and point
    guardrails (what they give up)."""
    out = []
    n, effect, wanted = (
        power.get("n"),
        power.get("detectable_effect"),
        cfg.hypothesis.min_improvement,
    )
    if effect is not None and 0 < wanted < effect:
        needed = examples_needed(n, effect, wanted)
        out.append(
            f"hypothesis.min_improvement {wanted:g} is below the smallest {power['metric']} "
            f"effect the {n}-example validation split can detect ({effect:.3f} at 80 % power): "
            f"about {needed} validation examples would be needed"
        )
    for rule in cfg.guardrails:
        if rule.test == "point":
            out.append(
                f"guardrail {rule.describe()} uses test: point: it is judged on the point "
                "estimate, so it passes or fails by the luck of the draw and no error rate is "
                "controlled"
            )
            continue
        if rule.scope != "every_category" or not rule.relative_to or rule.metric != "f1":
            continue
        margin = abs(rule.value)
        weak = {c: v for c, v in power["per_category"].items() if v["detectable_effect"] > margin}
        if margin > 0 and weak:
            worst = max(weak, key=lambda c: weak[c]["detectable_effect"])
            e = weak[worst]["detectable_effect"]
            out.append(
                f"guardrail {rule.describe()}: {len(weak)} of {len(power['per_category'])} "
                f"categories cannot tell a loss of {margin:g} (e.g. {worst!r}, "
                f"{weak[worst]['n']} examples, detects {e:.3f}): about "
                f"{examples_needed(n, e, margin)} validation examples would be needed; "
                "expect inconclusive verdicts"
            )
    return out
