"""One evaluation procedure for the baseline and every variant: batched inference and metrics.

Inference by architecture and task:
- encoder classification: the head's logits, argmax (probabilities kept per example);
- causal-LM classification: each label scored by the summed log-likelihood of its target tokens
  (label + EOS, rendered by the same Preprocessor as in training) given the prompt; argmax;
- causal-LM format and extraction: greedy generation with a KV cache and left padding, up to
  `evaluation.max_new_tokens`, stopping at EOS; only the new tokens are decoded, then parsed by
  the task.

Batches are formed from examples sorted by length (deterministic), so the same model gives the
same predictions run after run (`tunelab verify` relies on it).

Every evaluation records the sha256 of its spec: the locked evaluation spec (task,
preprocessing and evaluation settings, registered with the hypothesis) combined with the
preprocessor's template sha. Comparisons refuse results whose spec sha differ.

Records: `tunelab baseline` is a run of kind `baseline`; `tunelab eval RUN` is a run of kind
`eval` whose parent is RUN. Each holds `predictions-<split>.jsonl` and `metrics-<split>.json`.

- `evaluate_model(model, tokenizer, base, study, examples, split, *, labels=None,
  progress=None, expect_template_sha256=None, merge=None) -> (record, predictions)`:
  `progress(what, done, total)` (core.progress) once before the first batch (done 0) and
  after every batch; `merge` None checks the evaluation copy on the first batch
  (`tunelab.lib.inference.eval_copy`), True / False reproduce a recorded choice. Raises HypothesisError when study.config does not match the
  registered hypothesis.
- `record_evaluation(run, record, predictions)` writes `predictions-<split>.jsonl` and
  `metrics-<split>.json`: `{run_id, split, spec_sha256 (= sha256_json({evaluation_spec_sha256:
  locked, template_sha256: preprocessor's})), evaluation_spec_sha256, template_sha256,
  hypothesis_version, task_kind, labels, fields, n, seconds, examples_per_s, torch_threads,
  threads_from ("evaluation.num_threads" or "free cores (...)": `set_evaluation_threads`),
  merge {copy, merged, reason, merge_s, check_s, max_diff, atol, packed, unmerged}, cpu_s,
  cpu_share (`tunelab.core.env.cpu_share`), evaluation, generation (None unless the task
  generates: `tunelab.lib.probes.generation_timing`), metrics {..., per_category {label:
  {precision, recall, f1, support}}, per_field {path: {kind, slots, presence_rate, exact_match,
  normalized_match, precision, recall, f1, support, failures}}, scoring, failure_counts,
  confusion {labels, predicted, matrix}}}`.
- A prediction row: `{id, gold, raw_output, prediction, correct, verdicts}` (+ `scores` per
  label for classification, `parse_error` for generation, `image` for an image model).
- `find_evaluation(study, run_id, split) -> {eval_run, dir, record} | None` (the newest completed
  eval run of it, else the run's own metrics file) and `load_predictions(evaluation)` are how
  compare, verify and export find a run's evaluation. `rescore_predictions(task, predictions)`
  judges recorded rows again from their gold and raw output (compare does so for extraction
  records of another `metrics.scoring`). `predict_rows`, `load_base_model` and `pad_id_for`
  (`tunelab.lib.inference.generation`) serve verify and export.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.config import StudyConfig, generation_room_problem
from tunelab.core.config_sections import CLASSIFYING_KINDS
from tunelab.core.errors import EvaluationError, RunError
from tunelab.core.evidence import BASELINE_KIND, EVAL_KIND
from tunelab.core.hashing import sha256_json
from tunelab.core.progress import Progress
from tunelab.core.record_train import RunPreprocess
from tunelab.core.records import read_jsonl, write_json_atomic, write_jsonl_atomic
from tunelab.lib import metrics as M
from tunelab.lib.inference.eval_copy import EvalModels
from tunelab.lib.inference.generation import (  # noqa: F401  (pad helpers and generate_outputs: public here)
    batches_of,
    generate_outputs,
    pad_id_for,
    pad_sequences,
)
from tunelab.lib.models.identity import hub_source
from tunelab.stages.evaluate.predict import Ticker, model_device, predict_rows
from tunelab.stages.hypothesis.stage import evaluation_spec_sha, require_hypothesis

if TYPE_CHECKING:
    from tunelab.core.study import Run, Study

# Recorded scores are rounded (probabilities to 6 decimals, log-likelihoods to 4), so the fp32
# tolerance allows one unit in the 4th decimal; reduced precision gets a wider one. Verify
# reproduces recorded scores within it, and a merged copy must stay within it.
SCORE_ATOL = {"fp32": 2e-4, "bf16": 5e-2, "fp16": 5e-2}


def spec_sha256(locked_spec_sha: str, template_sha: str) -> str:
    """The sha an evaluation is compared under: the locked spec and the exact prompt template."""
    return sha256_json({"evaluation_spec_sha256": locked_spec_sha, "template_sha256": template_sha})


# ---------------------------------------------------------------- the evaluation


def _task_labels(study: Study, labels: Sequence[str] | None) -> list[str] | None:
    if labels is not None:
        return list(labels)
    cfg: StudyConfig = study.config
    if cfg.task.kind not in CLASSIFYING_KINDS:
        return None
    if cfg.task.labels:
        return list(cfg.task.labels)
    from tunelab.stages.data import load_snapshot

    return load_snapshot(study).labels


def evaluate_model(
    model: Any,
    tokenizer: Any,
    base: Any,
    study: Study,
    examples: Sequence[dict[str, Any]],
    split: str,
    *,
    labels: Sequence[str] | None = None,
    progress: Progress | None = None,
    expect_template_sha256: str | None = None,
    merge: bool | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate `model` on `examples` with the study's locked evaluation procedure.

    Args:
        base: the resolved base model (`.architecture` is "encoder" or "causal_lm").
        examples: rows of the split; only the first `evaluation.max_examples` are used.
        labels: the label set of a classification task (default: task.labels, else the latest
            snapshot's labels).
        expect_template_sha256: the template sha the model was trained with (its run's
            preprocess.json); a different rendering now is refused before any inference.
        merge: the model is evaluated through a copy made for the evaluation
            (`tunelab.lib.inference.eval_copy`: a LoRA adapter merged, linear layers packed on a CPU): None
            checks it on the first batch and falls back when it differs, True / False
            reproduce a recorded choice. The record's `merge` says what was used.
    Returns:
        (record, predictions). record = {"split", "spec_sha256", "evaluation_spec_sha256",
        "template_sha256", "hypothesis_version", "task_kind", "labels", "fields", "n",
        "seconds", "examples_per_s", "evaluation", "metrics": {...}}; predictions = one row per
        example {"id", "gold", "raw_output", "prediction", "correct", "verdicts"}.
    Raises:
        HypothesisError when no hypothesis is registered or study.yaml drifted from it;
        EvaluationError when there is nothing to evaluate.
    """
    from tunelab.lib.preprocess.mask_checks import check_template_match
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    cfg: StudyConfig = study.config
    hypothesis = require_hypothesis(study.root, cfg)
    ev = cfg.evaluation
    rows = list(examples)[: ev.max_examples] if ev.max_examples else list(examples)
    if not rows:
        raise EvaluationError(
            f"the {split} split has no examples to evaluate",
            hint="check the data snapshot (`tunelab data`) and evaluation.max_examples",
        )
    task = get_task(cfg, _task_labels(study, labels))
    if task.kind == "extraction":
        task.check_golds(rows)  # an unscorable gold stops here, not after minutes of decoding
    architecture = base.architecture
    pre = Preprocessor(tokenizer, cfg, task, architecture)
    check_template_match(expect_template_sha256, pre.template_sha256)
    tick = Ticker(progress or None, len(rows), f"evaluate {split} ({len(rows)} examples)")
    tick(0)  # a line at once in a pipe, before the first batch's minutes
    predictions, merge_record, timing, measured = _predict_split(
        model, tokenizer, pre, task, cfg, rows, merge, tick
    )
    record = {
        "split": split,
        "spec_sha256": spec_sha256(hypothesis["evaluation_spec_sha256"], pre.template_sha256),
        "evaluation_spec_sha256": hypothesis["evaluation_spec_sha256"],
        "template_sha256": pre.template_sha256,
        "hypothesis_version": hypothesis["version"],
        "hypothesis_sha256": hypothesis["sha256"],
        "task_kind": task.kind,
        "architecture": architecture,
        "base_hub": hub_source(getattr(base, "identity", None) or {}),  # repo and commit, or None
        "labels": list(task.labels) if task.labels else None,
        "fields": list(getattr(task, "fields", []) or []) or None,
        "n": len(rows),
        **measured,
        "evaluation": ev.model_dump(mode="json"),
        "metrics": compute_metrics(task, predictions),
        "generation": timing or None,
        "merge": merge_record,
    }
    return record, predictions


def _predict_split(
    model: Any,
    tokenizer: Any,
    pre: Any,
    task: Any,
    cfg: StudyConfig,
    rows: list[dict[str, Any]],
    merge: bool | None,
    tick: Ticker,
) -> tuple[list[dict[str, Any]], Any, dict[str, Any], dict[str, Any]]:
    """The predictions on `rows` in eval mode (the model's mode restored after), through the
    evaluation copy. Returns (predictions, the copy's record, generation timing, the
    record's time and device fields)."""
    import torch

    from tunelab.core.env import cpu_share

    torch.manual_seed(cfg.evaluation.seed)
    was_training = model.training
    model.eval()
    timing: dict[str, Any] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        models = EvalModels.prepare(model, merge, merge_atol(cfg), cfg.evaluation.batch_size)
        with torch.inference_mode():
            predictions = predict_rows(
                models, tokenizer, pre, task, cfg, rows, pre.architecture, tick, timing
            )
        merge_record = models.record
        del models  # the evaluation copy goes with it
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    threads, device = torch.get_num_threads(), model_device(model)
    measured = {
        "seconds": round(seconds, 3),
        "examples_per_s": round(len(rows) / seconds, 3) if seconds > 0 else None,
        "device": str(device),
        "torch_threads": threads,
        "cpu_s": round(cpu_s, 3),
        "cpu_share": cpu_share(cpu_s, seconds, threads, device),
    }
    return predictions, merge_record, timing, measured


def merge_atol(cfg: StudyConfig) -> float:
    """How far a merged copy's scores may drift from the model's: verify's tolerance."""
    from tunelab.core.env import device_kind
    from tunelab.stages.train.precision import resolve_precision

    return SCORE_ATOL.get(resolve_precision(cfg.training.precision, device_kind()), 2e-4)


def compute_metrics(task: Any, predictions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The task's metric suite from prediction rows (the same rows `compare` resamples)."""
    if task.kind == "classification":
        return M.classification_metrics(
            [p["gold"] for p in predictions], [p["prediction"] for p in predictions], task.labels
        )
    verdicts = [p["verdicts"] for p in predictions]
    if task.kind == "extraction":
        return M.extraction_metrics(verdicts, task.fields, task.paths)
    json_schema = getattr(task, "json_schema", None) is not None
    out = M.format_metrics(
        [v["format_valid"] for v in verdicts],
        [v["failure"] for v in verdicts],
        json_valid=[v["json_valid"] for v in verdicts] if json_schema else None,
        schema_valid=[v["schema_valid"] for v in verdicts] if json_schema else None,
        exact=[v["exact_match"] for v in verdicts],
    )
    return out


# ---------------------------------------------------------------- records


def record_evaluation(
    run: Run, record: dict[str, Any], predictions: Sequence[dict[str, Any]]
) -> tuple[Path, Path]:
    """Write predictions-<split>.jsonl then metrics-<split>.json into the run folder (never
    overwriting: a second evaluation of a run is a new `eval` run)."""
    split = record["split"]
    pred_path = write_jsonl_atomic(run.path(f"predictions-{split}.jsonl"), predictions)
    metrics_path = write_json_atomic(
        run.path(f"metrics-{split}.json"), {"run_id": run.id, **record}
    )
    return pred_path, metrics_path


def load_base_model(study: Study, labels: list[str] | None):
    """`(model, tokenizer, base)` for the study's base model, untrained, as evaluation loads it.

    `labels` sizes an encoder's classification head; the model is on `compute_device()`, where
    the runs it is compared with are evaluated.
    """
    from tunelab.lib.models import compute_device, load_model, load_tokenizer, resolve_base

    base = resolve_base(study)
    tokenizer = load_tokenizer(base)
    model = load_model(base, study.config, labels=labels).to(compute_device())
    return model, tokenizer, base


def set_evaluation_threads(cfg: StudyConfig) -> str:
    """Torch's CPU threads for inference: evaluation.num_threads, else the cores free now
    (more threads than free cores slow every step: they wait for each other). Returns where the
    count came from, for the record."""
    import torch

    from tunelab.core.env import free_cores

    if cfg.evaluation.num_threads:
        torch.set_num_threads(cfg.evaluation.num_threads)
        return "evaluation.num_threads"
    n, how = free_cores()
    torch.set_num_threads(n)
    return f"free cores ({how})"


def require_generation_room(cfg: StudyConfig) -> None:
    """A generating task's prompt is cut to leave room for `max_new_tokens`
    (`Preprocessor.prompt_ids(generate=)`): a budget as long as the window leaves none for the
    input. Checked before an evaluation records anything."""
    problem = generation_room_problem(cfg)
    if problem:
        raise EvaluationError(
            problem,
            hint="set evaluation.max_new_tokens just above the longest answer (`tunelab "
            "inspect` shows the target lengths) or raise preprocess.max_seq_len",
        )


def run(
    study: Study,
    run_id: str | None = None,
    *,
    split: str = "validation",
    final: bool = False,
    why: str | None = None,
    progress: Progress | None = None,
) -> tuple[Run, dict[str, Any]]:
    """Stages 4 and 8: `run(study)` is `tunelab baseline`, `run(study, RUN, ...)` is `tunelab
    eval RUN`; one evaluation procedure for both. Returns (run, metrics record)."""
    if run_id is not None:
        return _evaluate_run(study, run_id, split=split, final=final, why=why, progress=progress)
    if split != "validation" or final:
        raise EvaluationError(
            "the baseline is evaluated on the validation split",
            hint="evaluate the baseline run on the test split: `tunelab eval BASELINE --split "
            "test --final`",
        )
    return _baseline(study, progress=progress)


def _baseline(study: Study, *, progress: Progress | None = None) -> tuple[Run, dict[str, Any]]:
    """The untouched base model on the validation split, recorded as a run of kind `baseline`."""

    from tunelab.core.env import capture_env
    from tunelab.stages.data import load_snapshot

    cfg: StudyConfig = study.config
    require_generation_room(cfg)
    hypothesis = require_hypothesis(study.root, cfg)
    threads = set_evaluation_threads(cfg)
    snapshot = load_snapshot(study)
    labels = _task_labels_from(cfg, snapshot)
    split = "validation"
    examples = snapshot.rows(split)
    run = study.create_run(
        BASELINE_KIND,
        name="baseline",
        data_snapshot=snapshot.id,
        hypothesis=hypothesis,
        env=capture_env(),
        extra={"split": split, "evaluation_spec_sha256": evaluation_spec_sha(cfg)},
    )
    try:
        # load_model seeds a new classification head from training.seed: the head training
        # starts from, so the baseline is the untrained starting point of every variant.
        started = time.perf_counter()
        model, tokenizer, base = load_base_model(study, labels)
        load_s = time.perf_counter() - started
        record, predictions = evaluate_model(
            model, tokenizer, base, study, examples, split, labels=labels, progress=progress
        )
        # the model's load (libraries included), which `tunelab plan` sets against the smoke's
        # fresh-process load of an adapted checkpoint
        record["load_s"] = round(load_s, 3)
        record["threads_from"] = threads
        record["data_snapshot"] = snapshot.id
        record["base_identity_sha256"] = (base.identity or {}).get("sha256")
        record_evaluation(run, record, predictions)
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        run.set_status(status, f"{type(exc).__name__}: {exc}"[:500])
        raise
    run.set_status("completed")
    return run, {"run_id": run.id, **record}


def _task_labels_from(cfg: StudyConfig, snapshot: Any) -> list[str] | None:
    if cfg.task.kind not in CLASSIFYING_KINDS:
        return None
    return list(cfg.task.labels) if cfg.task.labels else list(snapshot.labels or [])


def _evaluate_run(
    study: Study,
    run_id: str,
    *,
    split: str = "validation",
    final: bool = False,
    why: str | None = None,
    progress: Progress | None = None,
) -> tuple[Run, dict[str, Any]]:
    """The baseline's procedure applied to a trained run (or the baseline
    itself on the test split), recorded as a run of kind `eval` whose parent is RUN.

    The test split opens only with `final=True`, through `tunelab.stages.data.open_test_split` (which
    logs the opening); the record carries how many openings the study has had.
    """

    from tunelab.core.env import capture_env
    from tunelab.stages.data import load_snapshot, open_test_split

    cfg: StudyConfig = study.config
    require_generation_room(cfg)
    hypothesis = require_hypothesis(study.root, cfg)
    target = study.get_run(run_id)
    row = target.row
    _check_evaluable(row, split, final)
    threads = set_evaluation_threads(cfg)
    snapshot = load_snapshot(study, row.data_snapshot)
    labels = _task_labels_from(cfg, snapshot)
    run = study.create_run(
        EVAL_KIND,
        name=f"eval-{split}",
        parent=row.id,
        why=why,
        data_snapshot=snapshot.id,
        hypothesis=hypothesis,
        env=capture_env(),
        extra={"evaluates": row.id, "split": split},
    )
    try:
        openings = None
        if split == "test":
            examples = open_test_split(
                study, snapshot, who="tunelab eval --final", why=why or "final", run_id=run.id
            )
            openings = len(study.ledger.test_openings())
        else:
            examples = snapshot.rows(split)
        started = time.perf_counter()
        model, tokenizer, base = _load_evaluated(study, target, labels)
        load_s = time.perf_counter() - started
        trained_with = target.path("preprocess.json")
        trained = RunPreprocess.read(trained_with) if trained_with.exists() else None
        template = trained.template_sha256 if trained else None
        record, predictions = evaluate_model(
            model, tokenizer, base, study, examples, split, labels=labels, progress=progress,
            expect_template_sha256=template,
        )  # fmt: skip
        record["evaluates"] = row.id
        record["load_s"] = round(load_s, 3)
        record["threads_from"] = threads
        record["data_snapshot"] = snapshot.id
        if openings is not None:
            record["test_openings"] = openings
            if openings > 1:
                record["warning"] = (
                    f"the sealed test split of this study has now been opened {openings} times; "
                    "results on it are no longer an unbiased estimate"
                )
        record_evaluation(run, record, predictions)
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        run.set_status(status, f"{type(exc).__name__}: {exc}"[:500])
        raise
    run.set_status("completed")
    return run, {"run_id": run.id, **record}


def _check_evaluable(row: Any, split: str, final: bool) -> None:
    """Refuse an evaluation of an evaluation, of a run that did not complete, of an unknown
    split, of the sealed test split without `final`, and `final` on another split."""
    if row.kind == EVAL_KIND:
        raise RunError(
            f"{row.id} is itself an evaluation (of {row.parent})",
            hint=f"evaluate the run it evaluates: `tunelab eval {row.parent}`",
        )
    if row.status != "completed":
        raise RunError(
            f"run {row.id} is {row.status}" + (f" ({row.reason})" if row.reason else ""),
            hint="only a completed run can be evaluated; `tunelab runs` lists them",
        )
    if split not in ("validation", "test"):
        raise EvaluationError(
            f"unknown split {split!r}", hint="use --split validation or --split test --final"
        )
    if split == "test" and not final:
        raise EvaluationError(
            "the test split is sealed",
            hint="open it once, for the final decision: `tunelab eval RUN --split test --final`",
        )
    if split != "test" and final:
        raise EvaluationError(
            "--final is only for the test split", hint="add --split test, or drop --final"
        )


def _load_evaluated(study: Study, target: Run, labels: list[str] | None) -> tuple[Any, Any, Any]:
    """The model a run evaluates: the untouched base for a baseline, else its checkpoint."""
    if target.row.kind == BASELINE_KIND:
        return load_base_model(study, labels)
    from tunelab.stages.train import load_run_model

    return load_run_model(study, target)


# ---------------------------------------------------------------- finding evaluations


def load_predictions(evaluation: dict[str, Any]) -> list[dict[str, Any]]:
    split = evaluation["record"]["split"]
    path = Path(evaluation["dir"]) / f"predictions-{split}.jsonl"
    if not path.exists():
        raise EvaluationError(
            f"{path}: predictions missing next to metrics-{split}.json",
            hint="the evaluation record is incomplete; run `tunelab eval RUN` again",
        )
    return read_jsonl(path)
