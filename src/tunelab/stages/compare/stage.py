"""Stage 9, compare: variants beside the baseline, found and checked in the study folder.

`run(study, run_ids=None, split=, baseline=)` finds each run's evaluation in the study folder,
refuses results of different evaluation specs, and compares each with the baseline
(`tunelab.stages.compare.evaluations.compare_evaluations`; flips and config diffs:
`tunelab.stages.compare.diffs`); `save_compare(study, record)` writes
`records/compare/<id>.json`. Failed, interrupted and unevaluated runs are listed with their
reason; naming a run evaluated under another spec is refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tunelab.core.evidence import all_hypotheses, latest_hypothesis
from tunelab.core.record_checks import FoundEvaluation
from tunelab.core.record_parts import CompareEntry, ConfigDiff, Delta
from tunelab.core.record_types import Compare, Evaluation, Hypothesis
from tunelab.core.run_parts import Prediction
from tunelab.lib.tasks.schema_scoring import SCORING_VERSION
from tunelab.stages.compare.diffs import config_diff
from tunelab.stages.compare.evaluations import compare_evaluations
from tunelab.stages.compare.verdicts import DecisionTests

if TYPE_CHECKING:
    from tunelab.core.record_types import RunConfig
    from tunelab.core.study import Study


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
    evaluation: FoundEvaluation
    record: Evaluation  # as scored for this comparison
    predictions: list[Prediction]
    config: RunConfig | None
    kind: str
    labels: list[str]
    fields: list[str]
    paths: list[str]


def _locked_task(hyp: Hypothesis, record: Evaluation, study: Any) -> Any:
    """The task of the hypothesis version an evaluation names (else the latest's)."""
    from tunelab.core.config_sections import TaskConfig
    from tunelab.lib.tasks import task_for

    versions = all_hypotheses(study.records)
    found = next((h for h in versions if h.version == record.hypothesis_version), hyp)
    spec = TaskConfig.model_validate(found.locked.task)
    return task_for(spec, record.labels)


def _scored(
    study: Any, hyp: Hypothesis, evaluation: FoundEvaluation
) -> tuple[Evaluation, list[Prediction], str | None]:
    """An evaluation's record and prediction rows; extraction rows scored by an earlier
    scorer are judged again from their raw outputs, with a note saying so."""
    from tunelab.stages.evaluate.predict import rescore_predictions
    from tunelab.stages.evaluate.stage import compute_metrics, load_predictions

    record, rows = evaluation.record, load_predictions(evaluation.found)
    source = evaluation.predictions_path
    scoring = record.scoring
    if record.task_kind != "extraction" or scoring == SCORING_VERSION:
        return record, Prediction.rows(rows, source), None
    task = _locked_task(hyp, record, study)
    rows = rescore_predictions(task, rows)
    record = Evaluation.of(record.path, {**record.raw, "metrics": compute_metrics(task, rows)})
    note = (
        f"{record.run_id or evaluation.eval_run} was scored by "
        f"{scoring or 'an earlier scorer'}: its {len(rows)} recorded outputs were judged again "
        f"by {SCORING_VERSION}"
    )
    return record, Prediction.rows(rows, source), note


def _find_baseline(study: Any, hyp: Hypothesis, baseline: str | None, split: str):
    from tunelab.core.errors import EvaluationError
    from tunelab.core.evidence import find_evaluation, latest_baseline

    if baseline:
        row = study.get_run(baseline).row
        found = find_evaluation(study, row.id, split)
    else:
        row, found = latest_baseline(study, split) or (None, None)
    if found is None:
        raise EvaluationError(
            f"no completed baseline evaluation on the {split} split",
            hint="run `tunelab baseline` first"
            if split == "validation"
            else "evaluate the baseline on it: `tunelab eval BASELINE --split test --final`",
        )
    evaluation = FoundEvaluation.of(found, split)
    record, rows, note = _scored(study, hyp, evaluation)
    base = _Baseline(
        row=row,
        evaluation=evaluation,
        record=record,
        predictions=rows,
        config=_run_config(study, row.id),
        kind=record.task_kind,
        labels=record.labels or [],
        fields=record.fields or [],
        paths=list(record.per_field) or list(record.fields or []),
    )
    return base, note


def _spec_mismatch(rec: Evaluation, base: Evaluation) -> str | None:
    if rec.spec_sha256 == base.spec_sha256:
        return None
    return (
        f"evaluation spec differs from the baseline's (run {(rec.spec_sha256 or '')[:12]}"
        f" vs baseline {(base.spec_sha256 or '')[:12]}; hypothesis "
        f"v{rec.hypothesis_version} vs v{base.hypothesis_version}, "
        f"template {(rec.template_sha256 or '')[:12]} vs "
        f"{(base.template_sha256 or '')[:12]}): results measured differently "
        "cannot be compared"
    )


def _compare_run(
    study: Any, hyp: Hypothesis, row: Any, base: _Baseline, split: str, explicit: bool
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
    raw_found = find_evaluation(study, row.id, split)
    if raw_found is None:
        return _not_compared(entry, f"not evaluated on {split}: run `tunelab eval {row.id}`")
    found = FoundEvaluation.of(raw_found, split)
    why_not = _spec_mismatch(found.record, base.record)
    if why_not is not None:
        if explicit:
            raise EvaluationError(
                f"refusing to compare {row.id} with baseline {base.row.id}: {why_not}",
                hint="re-evaluate both under the current spec (`tunelab baseline`, "
                f"`tunelab eval {row.id}`)",
            )
        return _not_compared(entry, why_not)
    rec, rows, note = _scored(study, hyp, found)
    locked = hyp.locked
    result = compare_evaluations(
        base.kind,
        base.predictions,
        rows,
        baseline_metrics=base.record.raw,
        variant_metrics=rec.raw,
        guardrails=locked.guardrails or [],
        primary_metric=locked.claim.primary_metric,
        min_improvement=float(locked.claim.min_improvement or 0.0),
        labels=base.labels,
        fields=base.fields,
        paths=base.paths,
        samples=study.config.evaluation.bootstrap_samples,
        seed=study.config.evaluation.seed,
        tests=DecisionTests.from_locked(locked),
        note=note,
    )
    diff = _config_diff(study, row, base)
    entry.update(
        compared=True,
        eval_run=found.eval_run,
        spec_sha256=rec.spec_sha256,
        config_diff=diff.raw,
        flags=diff.flags,
        **result,
    )
    return entry


def _config_diff(study: Any, row: Any, base: _Baseline) -> ConfigDiff:
    """The run's config against its parent's, or the baseline's for a run without one."""
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
    return ConfigDiff.of("the comparison", diff, f"runs[{row.id}].config_diff")


def _rows_to_compare(study: Study, run_ids: Sequence[str] | None, base: _Baseline) -> list[Any]:
    """The ledger rows of the named runs, or of every training run (refused when none)."""
    if run_ids:
        return [study.get_run(r).row for r in run_ids]
    rows = [r for r in study.list_runs() if r.kind == "train"]
    if not rows:
        from tunelab.core.errors import EvaluationError

        raise EvaluationError(
            f"no training run to compare with the baseline {base.row.id} yet",
            hint="run `tunelab train`, then `tunelab eval RUN`, then `tunelab compare`",
        )
    return rows


def _baseline_entry(base: _Baseline) -> dict[str, Any]:
    """The record's `baseline`: which run and evaluation, and its numeric metrics."""
    metrics = base.record.metrics.items()
    return {
        "run_id": base.row.id,
        "kind": base.row.kind,
        "eval_run": base.evaluation.eval_run,
        "spec_sha256": base.record.spec_sha256,
        "n": base.record.n,
        "metrics": {k: v for k, v in metrics if isinstance(v, (int, float))},
    }


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
    from tunelab.core.evidence import EVAL_KIND

    hyp = latest_hypothesis(study.records)
    if hyp is None:
        raise HypothesisError(
            "no hypothesis is registered for this study",
            hint="run `tunelab register`, then `tunelab baseline`",
        )
    base, base_note = _find_baseline(study, hyp, baseline, split)
    explicit = bool(run_ids)
    entries = []
    for row in _rows_to_compare(study, run_ids, base):
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
    claim = hyp.locked.claim
    tests = DecisionTests.from_locked(hyp.locked)
    return {
        "id": new_compare_id(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "study": study.config.name,
        "split": split,
        "task_kind": base.kind,
        "hypothesis_version": hyp.version,
        "hypothesis_sha256": hyp.sha256,
        "primary_metric": claim.primary_metric,
        "min_improvement": float(claim.min_improvement or 0.0),
        "bootstrap": {
            "samples": ev.bootstrap_samples,
            "seed": ev.seed,
            "confidence": tests.confidence,
        },
        "tests": tests.as_record(),
        "decision": study_decision(entries),
        "baseline": _baseline_entry(base),
        "runs": entries,
        "test_openings": len(openings),
        "warnings": warnings,
    }


def save_compare(study: Study, record: dict[str, Any]) -> Any:
    """Write records/compare/<id>.json (never overwritten) and note it in the ledger."""
    from tunelab.core.records import write_json_atomic

    compare_id = Compare.of("the comparison", record).id
    path = write_json_atomic(study.records / "compare" / f"{compare_id}.json", record)
    study.ledger.add_event(None, "compare", {"id": compare_id, "path": str(path)})
    return path


def study_decision(entries: Sequence[Mapping[str, Any] | CompareEntry]) -> str:
    """adopt when some compared run is adopted, inconclusive when none is but one is
    inconclusive, else reject (keep the baseline)."""
    rows = [
        e if isinstance(e, CompareEntry) else CompareEntry.of("the comparison", e, f"runs[{i}]")
        for i, e in enumerate(entries)
    ]
    found = {e.decision for e in rows if e.compared}
    return next((d for d in ("adopt", "inconclusive") if d in found), "reject")


def interval_verdict(primary: Mapping[str, Any] | Delta) -> str:
    """Where a delta's 95% interval lies: "above 0" (the record's `significant`), "below 0",
    "spans 0", or "-" without an interval."""
    if not isinstance(primary, Delta):
        primary = Delta.of("the primary metric", primary)
    low, high = primary.ci_low, primary.ci_high
    if low is None or high is None:
        return "-"
    return "above 0" if low > 0 else ("below 0" if high < 0 else "spans 0")
