"""`tunelab verify`: a checkpoint reloaded in a fresh process must reproduce its recorded predictions.

What is checked, in order:

1. the files of the run's final checkpoint against the sha256 recorded in its state.json (an
   edited adapter is caught here, before anything is loaded);
2. a new Python process (`python -m tunelab.stages.verify.fresh SPEC`) loads the base and the checkpoint from
   disk (`tunelab.stages.train.load_run_model`, the same loader evaluation uses), re-evaluates the
   examples of the recorded evaluation with the study's evaluation procedure and writes its
   predictions; every prediction and raw output must be identical, every score within `atol`;
3. the environment against the run's env.json: on another platform (torch, CUDA/ROCm, device)
   small numeric differences are expected, so the record says so and asks for `tunelab smoke`
   and `tunelab baseline` to be re-run there.

Each verification is recorded as `records/runs/<run>/verify-<n>.json` (never overwritten).
`tunelab smoke` uses the same fresh process (`fresh_evaluate`) and adds a logit probe.

`run(study, run_id, *, atol=None) -> record`: `passed`, `reason`, `model_run`,
`evaluation_run`, `checkpoint {path, files_checked, changed, missing, ok, damaged?}` (None for a
baseline), `predictions {n, matched, mismatched, missing, max_score_diff, atol, mismatches, ok}`,
`environment {same, differences, message}` (the fresh process's environment against the run's
env.json), `timings {load_s, eval_s, process_s}`; exit 0 verified, `VerifyFailed` (1) not, 2
when the run cannot be verified. The fresh process (`fresh_evaluate`, `probe_logits`):
`tunelab.stages.verify.fresh`; the pure comparisons: `tunelab.stages.verify.checks`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.env import platform_of
from tunelab.core.errors import CheckpointError, EvaluationError, ModelError, RunError
from tunelab.core.record_checks import FoundEvaluation, FreshOutcome, RunCompute
from tunelab.core.record_types import Evaluation
from tunelab.core.records import read_json, write_json_atomic
from tunelab.core.run_parts import CheckpointCheck, Prediction, Reproduced, RunEnv
from tunelab.stages.evaluate.stage import SCORE_ATOL
from tunelab.stages.train.checkpoint import check_checkpoint_files
from tunelab.stages.verify.checks import compare_env, compare_predictions, env_message
from tunelab.stages.verify.fresh import fresh_evaluate

if TYPE_CHECKING:
    from tunelab.core.study import Run, Study

# Raw logits of the smoke probe are compared unrounded.
LOGIT_ATOL = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-2}


class VerifyFailed(CheckpointError):
    """The reloaded checkpoint did not reproduce the recorded predictions (exit code 1)."""

    exit_code = 1


VERIFIABLE_KINDS = ("train", "smoke", "eval", "baseline")


# ---------------------------------------------------------------- the stage


def _target_of(study: Study, run: Run) -> tuple[Run, FoundEvaluation | None]:
    """(the run whose model is reloaded, its recorded validation evaluation or None)."""
    from tunelab.core.evidence import find_evaluation

    row = run.row
    if row.kind not in VERIFIABLE_KINDS:
        raise RunError(
            f"run {row.id} is of kind {row.kind!r}; verify reloads a trained model",
            hint="verify a train, smoke, eval or baseline run (`tunelab runs`)",
        )
    if row.kind == "eval":
        target = study.get_run(row.parent)
        own = run.dir / "metrics-validation.json"
        if not own.exists():
            raise EvaluationError(
                f"eval run {row.id} holds no validation predictions",
                hint=f"verify the trained run instead: `tunelab verify {row.parent}`",
            )
        found = {"eval_run": row.id, "dir": run.dir, "record": read_json(own)}
        return target, FoundEvaluation.of(found, "validation")
    found = find_evaluation(study, row.id, "validation")
    return run, None if found is None else FoundEvaluation.of(found, "validation")


def _checkpoint_of(run: Run) -> Path | None:
    from tunelab.stages.train.layout import final_checkpoint, latest_checkpoint

    root = run.dir / "checkpoints"
    return final_checkpoint(root) or latest_checkpoint(root)


def next_record_path(run_dir: Path, stem: str = "verify") -> Path:
    n = 1
    while (run_dir / f"{stem}-{n}.json").exists():
        n += 1
    return run_dir / f"{stem}-{n}.json"


def _write_record(run: Run, record: dict[str, Any]) -> Path:
    from tunelab.core.errors import StudyError

    for _ in range(20):  # another verify may take the same number: take the next one
        path = next_record_path(run.dir)
        record["record"] = path.name
        try:
            return write_json_atomic(path, record)
        except StudyError:
            continue
    raise AssertionError("could not find a free verify-<n>.json name")


def recorded_copy(evaluation: Evaluation | Mapping[str, Any]) -> bool:
    """Whether the recorded evaluation ran on its evaluation copy (`tunelab.lib.inference
    .eval_copy`; a record without `merge` ran on the model as loaded). A record as written is
    read as an `Evaluation` first."""
    if not isinstance(evaluation, Evaluation):
        evaluation = Evaluation.of("the recorded evaluation", evaluation)
    copy = evaluation.eval_copy
    return copy is not None and copy.on_copy


@dataclass
class _Outcome:
    """What re-evaluating found: the verdict, and the record's fields that say why."""

    passed: bool
    reason: str
    predictions: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None  # None: no fresh process answered
    fresh_spec_sha256: str | None = None
    fresh_env: dict[str, Any] | None = None  # the fresh process's capture_env

    def fields(self, reason: str) -> dict[str, Any]:
        """The record's fields, in the record's order, with `reason` as the reason."""
        if self.timings is None:
            return {"predictions": self.predictions, "passed": self.passed, "reason": reason}
        return {
            "predictions": self.predictions,
            "timings": self.timings,
            "fresh_spec_sha256": self.fresh_spec_sha256,
            "passed": self.passed,
            "reason": reason,
        }


def _reproduce(
    study: Study,
    model_run: str,
    snapshot: str,
    evaluation: FoundEvaluation,
    recorded: list[dict[str, Any]],
    atol: float,
    record_path: Path,
) -> _Outcome:
    """Re-evaluate in a fresh process and compare (`record_path`: the verify record's).

    A checkpoint or base model the new process cannot load is a failed verification; a study
    that cannot evaluate at all (hypothesis drifted, snapshot gone) raises.
    """
    eval_record = evaluation.record
    rows = Prediction.rows(recorded, evaluation.predictions_path)
    try:
        raw = fresh_evaluate(
            study,
            model_run,
            snapshot=snapshot,
            split=eval_record.split,
            ids=[r.id for r in rows],
            labels=eval_record.labels,
            num_threads=eval_record.torch_threads,
            merge=recorded_copy(eval_record),
        )
    except (CheckpointError, ModelError) as exc:
        return _Outcome(False, f"the checkpoint could not be reloaded: {exc.message}")
    fresh = FreshOutcome.of(record_path, raw, "the fresh process")
    raw_cmp = compare_predictions(rows, fresh.predictions, atol=atol)
    cmp = Reproduced.of(record_path, raw_cmp, "predictions")
    if cmp.ok:
        reason = (
            f"{cmp.n} recorded predictions reproduced in a fresh process "
            f"(max score difference {cmp.max_score_diff:.2g}, atol {atol:g})"
        )
    else:
        mismatches = cmp.mismatches
        first_id, what = (
            (mismatches[0].id, mismatches[0].what)
            if mismatches
            else ((cmp.missing or [])[:1], "missing")
        )
        reason = (
            f"{cmp.mismatched} of {cmp.n} recorded predictions not reproduced "
            f"(first: example {first_id!r}, {what})"
        )
    return _Outcome(
        passed=bool(cmp.ok),
        reason=reason,
        predictions=raw_cmp,
        timings={"load_s": fresh.load_s, "eval_s": fresh.eval_s, "process_s": fresh.process_s},
        fresh_spec_sha256=fresh.spec_sha256,
        fresh_env=fresh.env,
    )


def _used_precision(requested: str, compute_json: Path) -> str:
    """The precision a run trained in: its compute.json's, else `requested` resolved here."""
    from tunelab.core.env import device_kind
    from tunelab.stages.train.precision import resolve_precision

    if compute_json.exists():
        return RunCompute.read(compute_json).precision.used
    return resolve_precision(requested, device_kind())


def _score_atol(study: Study, target: Run) -> float:
    """The score tolerance of the precision the evaluated model computed in."""
    precision = study.config.training.precision
    if target.row.kind != "baseline":
        precision = target.record.training.precision or precision
    precision = _used_precision(precision, target.dir / "compute.json")
    return SCORE_ATOL.get(precision, 2e-4)


def _checked_files(target: Run, record_path: Path) -> CheckpointCheck:
    ckpt = _checkpoint_of(target)
    if ckpt is None:
        raw = {"path": None, "ok": False, "changed": [], "missing": ["all"]}
    else:
        raw = check_checkpoint_files(ckpt)
    return CheckpointCheck.of(record_path, raw, "checkpoint")


def _refused_checkpoint(ck: CheckpointCheck | None) -> str | None:
    """Why a checkpoint whose files failed their check is not loaded, or None to load it."""
    if ck is None or ck.ok:
        return None
    changed, missing = ck.changed or [], ck.missing or []
    bad = changed + missing
    if ck.damaged_files and not bad:
        return f"checkpoint {ck.location} cannot be loaded: " + "; ".join(
            f"{n}: {why}" for n, why in ck.damaged_files.items()
        )
    return (
        f"checkpoint {ck.location} does not match the sha256 recorded when it was written: "
        + ", ".join(f"{n} ({'changed' if n in changed else 'missing'})" for n in bad)
    )


def _differences(target: Run, current: RunEnv) -> list[dict[str, Any]]:
    """What of `current` differs from the run's env.json (`checks.compare_env`)."""
    env_path = target.dir / "env.json"
    return compare_env(RunEnv.read(env_path) if env_path.exists() else None, current)


def _environment_of(
    run_id: str, current: RunEnv, differences: list[dict[str, Any]]
) -> dict[str, Any]:
    """The record's `environment`: `current` against run `run_id`'s env.json."""
    return {
        "same": not differences,
        "differences": differences,
        "message": env_message(run_id, differences),
        "torch": current.torch,
        "backend": current.backend,
        "devices": current.device_names,
        "platform": platform_of(current.raw),  # the dossier's platforms section
    }


def _evaluation_of(study: Study, run: Run) -> tuple[Run, FoundEvaluation]:
    """The run whose model is reloaded and its recorded evaluation; refused when it cannot be
    verified at all."""
    target, evaluation = _target_of(study, run)
    trow = target.row
    if trow.status != "completed":
        raise RunError(
            f"run {trow.id} is {trow.status}" + (f" ({trow.reason})" if trow.reason else ""),
            hint="only a completed run has a final checkpoint to verify",
        )
    if evaluation is None:
        raise EvaluationError(
            f"run {trow.id} has no recorded validation predictions to reproduce",
            hint=f"evaluate it first: `tunelab eval {trow.id}`",
        )
    return target, evaluation


def run(study: Study, run_id: str, *, atol: float | None = None) -> dict[str, Any]:
    """`tunelab verify RUN`: the checks of this module's docstring, recorded.

    Returns the record (with `passed` and `reason`, and `path`). Raises RunError or
    EvaluationError when the run cannot be verified at all (not completed, no recorded
    predictions).
    """
    from tunelab.core.env import capture_env
    from tunelab.core.ledger import utc_now
    from tunelab.stages.evaluate.stage import load_predictions
    from tunelab.stages.hypothesis.stage import require_hypothesis

    require_hypothesis(study.root, study.config)  # the evaluation procedure must be the locked one
    run = study.get_run(run_id)
    target, evaluation = _evaluation_of(study, run)
    trow = target.row
    recorded = load_predictions(evaluation.found)
    eval_record = evaluation.record
    atol = _score_atol(study, target) if atol is None else atol
    started = time.perf_counter()
    snapshot = eval_record.data_snapshot or trow.data_snapshot
    record: dict[str, Any] = {
        "run_id": run.id,
        "model_run": trow.id,
        "model_kind": trow.kind,
        "evaluation_run": evaluation.eval_run,
        "split": eval_record.split,
        "data_snapshot": snapshot,
        "spec_sha256": eval_record.spec_sha256,
        "started_at": utc_now(),
    }
    where = next_record_path(run.dir)  # where the record will be written, to name in errors

    # 1. checkpoint files
    checkpoint = None if trow.kind == "baseline" else _checked_files(target, where)
    record["checkpoint"] = None if checkpoint is None else checkpoint.raw
    # 2. the fresh process, unless the files already failed
    refused = _refused_checkpoint(checkpoint)
    if refused:
        outcome = _Outcome(False, refused)
    else:
        outcome = _reproduce(study, trow.id, snapshot, evaluation, recorded, atol, where)
    # 3. environment (recorded whatever the outcome): the fresh process's own, which is the one
    # that re-evaluated; this process's where none ran (it then imports torch for it)
    current = RunEnv.of(where, outcome.fresh_env or capture_env(), "the environment")
    differences = _differences(target, current)
    reason = outcome.reason
    if not outcome.passed and differences:
        reason += "; the environment differs from the run's (see environment)"
    record.update(outcome.fields(reason))
    record["environment"] = _environment_of(trow.id, current, differences)
    record["seconds"] = round(time.perf_counter() - started, 3)
    record["finished_at"] = utc_now()
    path = _write_record(run, record)
    record["path"] = str(path)
    study.ledger.add_event(
        run.id,
        "verify",
        {"record": path.name, "passed": outcome.passed, "reason": reason[:300]},
    )
    return record
