"""Comparing variants with the baseline: paired statistics, guardrails, flips and config diffs.

Pure parts (values in, values out): `flips`, `config_diff`, `compare_evaluations`; the
statistics themselves (paired bootstrap, McNemar, bounds, Holm, TOST) live in
`tunelab.lib.statistics`. The edge (`run`) finds each run's evaluation in the study
folder, refuses results of different evaluation specs, and writes `records/compare/<id>.json`.

`compare_evaluations(..., fields=, paths=)`; `run(study, run_ids=None, split=,
baseline=)` + `save_compare(study, record)` write `records/compare/<id>.json`. Failed,
interrupted and unevaluated runs are listed with their reason; naming a run evaluated under
another spec is refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from tunelab.core.config import CLASSIFYING_KINDS
from tunelab.lib.statistics import (
    Stat,
    f1_stats,
    mcnemar,
    mean_stat,
    paired_draws,
    ratio_stat,
    summarize_draws,
)
from tunelab.lib.tasks.schema_scoring import SCORING_VERSION
from tunelab.stages.compare.guardrails import (
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
from tunelab.stages.hypothesis.stage import diff_dicts

if TYPE_CHECKING:
    from tunelab.core.record_types import RunConfig
    from tunelab.core.study import Study

# ---------------------------------------------------------------- flips


def flips_by_category(
    rows: Sequence[Mapping[str, Any]],
    baseline_correct: Sequence[bool],
    variant_correct: Sequence[bool],
    labels: Sequence[str],
) -> dict[str, dict[str, int]]:
    """{category: {"improved": wrong -> right, "regressed": right -> wrong}} by gold label."""
    out = {label: {"improved": 0, "regressed": 0} for label in labels}
    for row, a, b in zip(rows, baseline_correct, variant_correct, strict=True):
        if a != b and row.get("gold") in out:
            out[row["gold"]]["improved" if b else "regressed"] += 1
    return out


def flips(
    ids: Sequence[str], baseline_correct: Sequence[bool], variant_correct: Sequence[bool]
) -> dict[str, Any]:
    """The examples whose verdict changed: improved (wrong -> right) and regressed."""
    improved = [i for i, a, b in zip(ids, baseline_correct, variant_correct, strict=True) if b > a]
    regressed = [i for i, a, b in zip(ids, baseline_correct, variant_correct, strict=True) if a > b]
    return {
        "improved": improved,
        "regressed": regressed,
        "num_improved": len(improved),
        "num_regressed": len(regressed),
    }


# ---------------------------------------------------------------- config diff

# Parameter groups, matched on the dotted config path (first match wins).
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("adaptation", ("adaptation.",)),
    (
        "precision and memory",
        (
            "training.precision",
            "training.activation_checkpointing",
            "training.packing",
            "model.dtype",
        ),
    ),
    (
        "optimizer and schedule",
        (
            "training.optimizer",
            "training.lr",
            "training.weight_decay",
            "training.betas",
            "training.schedule",
            "training.warmup_steps",
            "training.grad_clip",
            "training.max_steps",
            "training.num_epochs",
            "training.seed",
            "training.micro_batch_size",
            "training.grad_accum_steps",
        ),
    ),
    ("data", ("data.", "data_snapshot", "preprocess.")),
    ("evaluation", ("evaluation.", "task.")),
    (
        "bookkeeping",
        (
            "name",
            "budget.",
            "training.eval_every_steps",
            "training.checkpoint_every_steps",
            "training.keep_last_checkpoints",
            "training.update_check_steps",
            "training.num_threads",
            "training.log_to",
        ),
    ),
]
# Groups that do not change what is learned or measured: never counted as "a change".
NEUTRAL_GROUPS = {"bookkeeping"}
SEED_PATHS = ("training.seed", "data.splits.seed", "evaluation.seed")
BUDGET_PATHS = ("training.max_steps", "training.num_epochs")


def _matches(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p.rstrip(".") or path.startswith(p) for p in prefixes) or any(
        path.startswith(p + "[") for p in prefixes
    )


def group_of(path: str) -> str:
    for name, prefixes in GROUPS:
        if _matches(path, prefixes):
            return name
    return "other"


def config_diff(
    parent: Mapping[str, Any],
    child: Mapping[str, Any],
    *,
    why: str | None = None,
    parent_snapshot: str | None = None,
    child_snapshot: str | None = None,
) -> dict[str, Any]:
    """The grouped config changes of a variant against its parent, and the warnings they earn.

    Micro-batch size and accumulation steps count as "precision and memory" when their product
    (the effective batch) is unchanged, else as "optimizer and schedule". Flags: more than one
    group changed; a seed, the training budget (max_steps, num_epochs) or the data (including
    the data snapshot) changed without a `--why`.
    Returns {"changes": [{path, old, new, group}], "groups": [...], "flags": [...], "why"}.
    """
    changes = diff_dicts(dict(parent), dict(child))
    if parent_snapshot != child_snapshot:
        changes.append({"path": "data_snapshot", "old": parent_snapshot, "new": child_snapshot})
    tp, tc = parent.get("training", {}) or {}, child.get("training", {}) or {}
    same_batch = tp.get("micro_batch_size", 1) * tp.get("grad_accum_steps", 1) == tc.get(
        "micro_batch_size", 1
    ) * tc.get("grad_accum_steps", 1)
    for change in changes:
        group = group_of(change["path"])
        if same_batch and change["path"] in (
            "training.micro_batch_size",
            "training.grad_accum_steps",
        ):
            group = "precision and memory"
        change["group"] = group
    groups = sorted({c["group"] for c in changes if c["group"] not in NEUTRAL_GROUPS})
    flags = []
    if len(groups) > 1:
        flags.append(
            f"changes {len(groups)} parameter groups ({', '.join(groups)}): "
            "the effect cannot be attributed to one change"
        )
    has_why = bool(why and why.strip())
    paths = [c["path"] for c in changes]
    for what, hit in (
        ("seed", [p for p in paths if p in SEED_PATHS]),
        ("training budget", [p for p in paths if p in BUDGET_PATHS]),
        ("data", [p for p in paths if group_of(p) == "data"]),
    ):
        if hit and not has_why:
            flags.append(f"{what} changed ({', '.join(hit)}) without a --why")
    return {"changes": changes, "groups": groups, "flags": flags, "why": why}


# ---------------------------------------------------------------- per-example tables


def example_stats(
    kind: str,
    rows: Sequence[Mapping[str, Any]],
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
    correct = [bool(r.get("correct")) for r in rows]
    if kind == "classification":
        f1 = f1_stats([r["gold"] for r in rows], [r["prediction"] for r in rows], labels)
        overall["accuracy"] = mean_stat(correct)
        overall["macro_f1"] = f1["macro_f1"]
        overall["weighted_f1"] = f1["weighted_f1"]
        for key in CATEGORY_KEYS:
            per_category[key] = f1[f"per_category_{key}"]
        return overall, per_category, per_field
    verdicts = [r.get("verdicts") or {} for r in rows]
    if kind == "format":
        for key, metric in (
            ("format_valid", "format_valid_rate"),
            ("json_valid", "json_valid_rate"),
            ("schema_valid", "schema_valid_rate"),
            ("exact_match", "exact_match"),
        ):
            if rows and all(v.get(key) is not None for v in verdicts):
                overall[metric] = mean_stat([bool(v[key]) for v in verdicts])
        return overall, per_category, per_field
    overall |= _extraction_stats(verdicts, list(fields), list(paths or fields), per_field)
    return overall, per_category, per_field


def _extraction_stats(
    verdicts: list[Mapping[str, Any]],
    fields: list[str],
    paths: list[str],
    per_field: dict[str, Stat],
) -> dict[str, Stat]:
    """Extraction's statistics from the per-path counts of each example (see
    metrics.extraction_metrics): fills `per_field` ([B, P]) and returns the overall ones."""
    keys = ("slots", "present", "empty_match", "exact", "match", "tp", "pred", "gold")
    counts = {  # key -> [n, P]
        key: np.array(
            [[((v.get("paths") or {}).get(p) or {}).get(key, 0) for p in paths] for v in verdicts],
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
        "json_valid_rate": mean_stat([bool(v.get("json_valid")) for v in verdicts]),
        "schema_valid_rate": mean_stat([bool(v.get("schema_valid")) for v in verdicts]),
    }
    for name in rates:
        stat = per_field[name]
        overall[f"field_{name}"] = lambda w, stat=stat: stat(w)[:, top].mean(axis=1)
    overall["field_micro_f1"] = ratio_stat(
        2 * counts["tp"][:, top].sum(axis=1),
        (counts["pred"] + counts["gold"])[:, top].sum(axis=1),
    )
    overall["exact_match"] = mean_stat([bool(v.get("exact_match")) for v in verdicts])
    overall["all_fields_match_rate"] = mean_stat(
        [bool(v.get("all_fields_match")) for v in verdicts]
    )
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
) -> dict[str, Any]:
    """Everything one comparison row holds, computed from two evaluations' records.

    Examples are paired by id (those in both); the notes say how many were left unpaired.
    `paths`: an extraction schema's paths (default `fields`), each with paired intervals.
    `tests`: the locked confidence, interval method, multiplicity and goal (default: the
    documented defaults). The row's `decision` is adopt, reject or inconclusive (see
    `tunelab.stages.compare.verdicts`).
    """
    base_by_id = {r["id"]: r for r in baseline_rows}
    var_by_id = {r["id"]: r for r in variant_rows}
    ids = [i for i in base_by_id if i in var_by_id]
    notes = []
    only_base, only_var = len(base_by_id) - len(ids), len(var_by_id) - len(ids)
    if only_base or only_var:
        notes.append(
            f"paired over {len(ids)} shared examples ({only_base} only in the baseline, "
            f"{only_var} only in the variant)"
        )
    base = [base_by_id[i] for i in ids]
    var = [var_by_id[i] for i in ids]
    paths = list(paths or fields)
    b_overall, b_cat, b_field = example_stats(kind, base, labels, fields, paths)
    v_overall, v_cat, v_field = example_stats(kind, var, labels, fields, paths)
    pairs = {m: (b_overall[m], v_overall[m]) for m in b_overall if m in v_overall}
    pairs |= {f"per_category.{m}": (b_cat[m], v_cat[m]) for m in b_cat}
    pairs |= {f"per_field.{m}": (b_field[m], v_field[m]) for m in b_field}
    tests = tests or DecisionTests()
    point, draws = paired_draws(
        pairs | value_pairs(guardrails, pairs), len(ids), samples=samples, seed=seed
    )
    boot = summarize_draws({k: point[k] for k in pairs}, draws, tests.confidence)

    metrics = {m: r for m, r in boot.items() if "." not in m}
    b_inner, v_inner = inner_metrics(baseline_metrics), inner_metrics(variant_metrics)
    if primary_metric not in metrics and primary_metric in v_inner:
        bv, vv = b_inner.get(primary_metric), v_inner.get(primary_metric)
        delta = None if bv is None or vv is None else vv - bv
        metrics[primary_metric] = {
            "baseline": bv,
            "variant": vv,
            "delta": delta,
            "ci_low": None,
            "ci_high": None,
        }
    per_category = _per_item(boot, "per_category", labels, b_inner, v_inner, CATEGORY_KEYS)
    per_field = _per_item(boot, "per_field", paths, b_inner, v_inner, FIELD_KEYS)
    primary = dict(metrics.get(primary_metric) or {})
    delta = primary.get("delta")
    primary.update(
        metric=primary_metric,
        min_improvement=min_improvement,
        meets_min_improvement=None if delta is None else delta >= min_improvement,
        significant=None if primary.get("ci_low") is None else primary["ci_low"] > 0,
    )
    base_ok = [bool(r.get("correct")) for r in base]
    var_ok = [bool(r.get("correct")) for r in var]
    estimate_of = estimates(point, draws, labels=labels, paths=paths, n=len(ids), tests=tests)
    primary |= primary_verdict(
        primary,
        estimate_of(primary_metric, "overall", None, True),
        tests,
        min_improvement,
        len(ids),
    )
    verdicts = judge_guardrails(
        check_guardrails(guardrails, baseline_metrics, variant_metrics),
        estimate_of,
        n=len(ids),
        confidence=tests.confidence,
        multiplicity=tests.multiplicity,
    )
    guards = overall_verdict(verdicts)
    decision, reasons = run_decision(primary, verdicts, guards)
    changed = flips(ids, base_ok, var_ok)
    if kind in CLASSIFYING_KINDS:
        changed["by_category"] = flips_by_category(base, base_ok, var_ok, labels)
    return {
        "n_paired": len(ids),
        "notes": notes,
        "primary": primary,
        "metrics": metrics,
        "mcnemar": mcnemar(base_ok, var_ok),
        "per_category": per_category,
        "per_field": per_field,
        "guardrails": verdicts,
        "guardrails_pass": all(v["pass"] for v in verdicts),
        "guardrails_verdict": guards,
        "decision": decision,
        "decision_reasons": reasons,
        "flips": changed,
    }


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


def new_compare_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"compare-{stamp}-{secrets.token_hex(3)}"


# ---------------------------------------------------------------- the study edge


def _run_config(study: Study, run_id: str) -> RunConfig | None:
    from tunelab.core.record_types import RunConfig

    path = study.runs_dir / run_id / "config.json"
    return RunConfig.read(path) if path.exists() else None


def _not_compared(entry: dict[str, Any], why: str) -> dict[str, Any]:
    entry.update(compared=False, not_compared_reason=why)
    return entry


@dataclass
class _Baseline:
    """What every run of one comparison is set against."""

    row: Any
    evaluation: dict[str, Any]
    record: dict[str, Any]
    predictions: list[dict[str, Any]]
    config: RunConfig | None
    kind: str
    labels: list[str]
    fields: list[str]
    paths: list[str]


def _locked_task(hyp: Mapping[str, Any], record: Mapping[str, Any], study: Any) -> Any:
    """The task of the hypothesis version an evaluation names (else the latest's)."""
    from tunelab.core.config import TaskConfig
    from tunelab.core.evidence import all_hypotheses
    from tunelab.lib.tasks import task_for

    version = record.get("hypothesis_version")
    found = next((h for h in all_hypotheses(study.records) if h["version"] == version), hyp)
    spec = TaskConfig.model_validate(found["content"]["evaluation_spec"]["task"])
    return task_for(spec, record.get("labels"))


def _scored(
    study: Any, hyp: Mapping[str, Any], evaluation: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
    """An evaluation's record and prediction rows; extraction rows scored by an earlier
    scorer are judged again from their raw outputs, with a note saying so."""
    from tunelab.stages.evaluate.stage import compute_metrics, load_predictions, rescore_predictions

    record, rows = evaluation["record"], load_predictions(evaluation)
    scoring = inner_metrics(record).get("scoring")
    if record.get("task_kind") != "extraction" or scoring == SCORING_VERSION:
        return record, rows, None
    task = _locked_task(hyp, record, study)
    rows = rescore_predictions(task, rows)
    record = {**record, "metrics": compute_metrics(task, rows)}
    note = (
        f"{record.get('run_id') or evaluation['eval_run']} was scored by "
        f"{scoring or 'an earlier scorer'}: its {len(rows)} recorded outputs were judged again "
        f"by {SCORING_VERSION}"
    )
    return record, rows, note


def _find_baseline(study: Any, hyp: Mapping[str, Any], baseline: str | None, split: str):
    from tunelab.core.errors import EvaluationError
    from tunelab.core.evidence import find_evaluation, latest_baseline

    if baseline:
        row = study.get_run(baseline).row
        evaluation = find_evaluation(study, row.id, split)
    else:
        row, evaluation = latest_baseline(study, split) or (None, None)
    if evaluation is None:
        raise EvaluationError(
            f"no completed baseline evaluation on the {split} split",
            hint="run `tunelab baseline` first"
            if split == "validation"
            else "evaluate the baseline on it: `tunelab eval BASELINE --split test --final`",
        )
    record, rows, note = _scored(study, hyp, evaluation)
    per_field = inner_metrics(record).get("per_field") or {}
    base = _Baseline(
        row=row,
        evaluation=evaluation,
        record=record,
        predictions=rows,
        config=_run_config(study, row.id),
        kind=record["task_kind"],
        labels=record.get("labels") or [],
        fields=record.get("fields") or [],
        paths=list(per_field) or list(record.get("fields") or []),
    )
    return base, note


def _spec_mismatch(rec: Mapping[str, Any], base: Mapping[str, Any]) -> str | None:
    if rec.get("spec_sha256") == base.get("spec_sha256"):
        return None
    return (
        f"evaluation spec differs from the baseline's (run {rec.get('spec_sha256', '')[:12]}"
        f" vs baseline {base.get('spec_sha256', '')[:12]}; hypothesis "
        f"v{rec.get('hypothesis_version')} vs v{base.get('hypothesis_version')}, "
        f"template {rec.get('template_sha256', '')[:12]} vs "
        f"{base.get('template_sha256', '')[:12]}): results measured differently "
        "cannot be compared"
    )


def _compare_run(
    study: Any, hyp: Mapping[str, Any], row: Any, base: _Baseline, split: str, explicit: bool
) -> dict[str, Any]:
    """One row of the comparison: the run against the baseline, or why it is not compared."""
    from tunelab.core.errors import EvaluationError
    from tunelab.core.evidence import find_evaluation

    entry: dict[str, Any] = {
        "run_id": row.id,
        "name": row.name,
        "kind": row.kind,
        "parent": row.parent,
        "status": row.status,
        "reason": row.reason,
        "why": row.why,
    }
    if row.status != "completed":
        return _not_compared(entry, f"{row.status}: {row.reason or 'no reason recorded'}")
    found = find_evaluation(study, row.id, split)
    if found is None:
        return _not_compared(entry, f"not evaluated on {split}: run `tunelab eval {row.id}`")
    why_not = _spec_mismatch(found["record"], base.record)
    if why_not is not None:
        if explicit:
            raise EvaluationError(
                f"refusing to compare {row.id} with baseline {base.row.id}: {why_not}",
                hint="re-evaluate both under the current spec (`tunelab baseline`, "
                f"`tunelab eval {row.id}`)",
            )
        return _not_compared(entry, why_not)
    rec, rows, note = _scored(study, hyp, found)
    content = hyp["content"]
    result = compare_evaluations(
        base.kind,
        base.predictions,
        rows,
        baseline_metrics=base.record,
        variant_metrics=rec,
        guardrails=content["guardrails"],
        primary_metric=content["hypothesis"]["primary_metric"],
        min_improvement=float(content["hypothesis"].get("min_improvement") or 0.0),
        labels=base.labels,
        fields=base.fields,
        paths=base.paths,
        samples=study.config.evaluation.bootstrap_samples,
        seed=study.config.evaluation.seed,
        tests=DecisionTests.from_locked(content),
    )
    if note:
        result["notes"].append(note)
    run_cfg = _run_config(study, row.id)
    parent_id = row.parent or base.row.id
    parent_cfg = _run_config(study, parent_id) if row.parent else base.config
    diff = config_diff(
        parent_cfg.config if parent_cfg else {},
        run_cfg.config if run_cfg else {},
        why=row.why,
        parent_snapshot=parent_cfg.data_snapshot if parent_cfg else None,
        child_snapshot=run_cfg.data_snapshot if run_cfg else None,
    )
    diff["against"] = parent_id
    entry.update(
        compared=True,
        eval_run=found["eval_run"],
        spec_sha256=rec.get("spec_sha256"),
        config_diff=diff,
        flags=diff["flags"],
        **result,
    )
    return entry


def run(
    study: Study,
    run_ids: Sequence[str] | None = None,
    *,
    split: str = "validation",
    baseline: str | None = None,
) -> dict[str, Any]:
    """Compare runs with the baseline on `split`, from their evaluation records.

    Default: every run of kind `train` (failed, interrupted and unevaluated ones are listed as
    rows with their reason). A named run whose evaluation spec differs from the baseline's is
    refused (EvaluationError); in the default listing it becomes a row saying why.
    Returns the compare record (not yet saved; see `save_compare`).
    """
    from tunelab.core.errors import HypothesisError
    from tunelab.core.evidence import EVAL_KIND, latest_hypothesis

    hyp = latest_hypothesis(study.records)
    if hyp is None:
        raise HypothesisError(
            "no hypothesis is registered for this study",
            hint="run `tunelab register`, then `tunelab baseline`",
        )
    base, base_note = _find_baseline(study, hyp, baseline, split)
    explicit = bool(run_ids)
    if explicit:
        rows = [study.get_run(r).row for r in run_ids or []]
    else:
        rows = [r for r in study.list_runs() if r.kind == "train"]
        if not rows:
            from tunelab.core.errors import EvaluationError

            raise EvaluationError(
                f"no training run to compare with the baseline {base.row.id} yet",
                hint="run `tunelab train`, then `tunelab eval RUN`, then `tunelab compare`",
            )
    entries = []
    for row in rows:
        if row.id == base.row.id:
            continue
        if row.kind == EVAL_KIND and row.parent:
            row = study.get_run(row.parent).row
        entries.append(_compare_run(study, hyp, row, base, split, explicit))

    openings = study.ledger.test_openings()
    warnings = [base_note] if base_note else []
    if len(openings) > 1:
        warnings.append(
            f"the sealed test split has been opened {len(openings)} times in this study; "
            "test results after the first opening are biased by that choice"
        )
    ev = study.config.evaluation
    content = hyp["content"]
    tests = DecisionTests.from_locked(content)
    return {
        "id": new_compare_id(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "study": study.config.name,
        "split": split,
        "task_kind": base.kind,
        "hypothesis_version": hyp["version"],
        "hypothesis_sha256": hyp["sha256"],
        "primary_metric": content["hypothesis"]["primary_metric"],
        "min_improvement": float(content["hypothesis"].get("min_improvement") or 0.0),
        "bootstrap": {
            "samples": ev.bootstrap_samples,
            "seed": ev.seed,
            "confidence": tests.confidence,
        },
        "tests": tests.as_record(),
        "decision": study_decision(entries),
        "baseline": {
            "run_id": base.row.id,
            "kind": base.row.kind,
            "eval_run": base.evaluation["eval_run"],
            "spec_sha256": base.record.get("spec_sha256"),
            "n": base.record.get("n"),
            "metrics": {
                k: v for k, v in inner_metrics(base.record).items() if isinstance(v, (int, float))
            },
        },
        "runs": entries,
        "test_openings": len(openings),
        "warnings": warnings,
    }


def save_compare(study: Study, record: dict[str, Any]) -> Any:
    """Write records/compare/<id>.json (never overwritten) and note it in the ledger."""
    from tunelab.core.records import write_json_atomic

    path = write_json_atomic(study.records / "compare" / f"{record['id']}.json", record)
    study.ledger.add_event(None, "compare", {"id": record["id"], "path": str(path)})
    return path


def study_decision(entries: Sequence[Mapping[str, Any]]) -> str:
    """adopt when some compared run is adopted, inconclusive when none is but one is
    inconclusive, else reject (keep the baseline)."""
    found = {e.get("decision") for e in entries if e.get("compared")}
    return next((d for d in ("adopt", "inconclusive") if d in found), "reject")


def interval_verdict(primary: dict[str, Any]) -> str:
    """Where a delta's 95% interval lies: "above 0" (the record's `significant`), "below 0",
    "spans 0", or "-" without an interval."""
    low, high = primary.get("ci_low"), primary.get("ci_high")
    if low is None or high is None:
        return "-"
    return "above 0" if low > 0 else ("below 0" if high < 0 else "spans 0")
