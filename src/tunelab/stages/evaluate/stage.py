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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.config import CLASSIFYING_KINDS, StudyConfig, generation_room_problem
from tunelab.core.errors import EvaluationError, RunError
from tunelab.core.evidence import BASELINE_KIND, EVAL_KIND
from tunelab.core.hashing import sha256_json
from tunelab.core.progress import Progress
from tunelab.core.records import read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
from tunelab.lib import metrics as M
from tunelab.lib.inference.decoding import left_padded_positions
from tunelab.lib.inference.eval_copy import EvalModels, as_models, close_scores
from tunelab.lib.inference.generation import (  # noqa: F401  (pad helpers and generate_outputs: public here)
    batches_of,
    generate_outputs,
    pad_id_for,
    pad_sequences,
)
from tunelab.lib.models.identity import hub_source
from tunelab.lib.probes import generation_timing
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


# ---------------------------------------------------------------- batching helpers


def _device(model: Any):
    return next(model.parameters()).device


def _tensor_rows(compare: Any) -> Any:
    """A comparison of score lists applied to [batch, labels] tensors."""
    return lambda a, b: compare(a.tolist(), b.tolist())


class _Ticker:
    """Counts the examples done and tells the caller's progress callback (if any)."""

    def __init__(self, progress: Progress | None, total: int, what: str):
        self.progress, self.total, self.what = progress, total, what
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.what, self.done, self.total)


# ---------------------------------------------------------------- inference


def predict_encoder(
    model: Any,
    encoded: Sequence[dict[str, Any]],
    labels: Sequence[str],
    pad_id: int,
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
) -> list[dict[str, Any]]:
    """Label and per-label probabilities of each encoded example ([CLS] head logits)."""
    import torch

    out: list[dict[str, Any] | None] = [None] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]["input_ids"]), i))
    models = as_models(model)
    device = models.device
    for batch in batches_of(order, batch_size):
        ids, mask = pad_sequences([encoded[i]["input_ids"] for i in batch], pad_id, left=False)

        def forward(m: Any, ids: Any = ids, mask: Any = mask) -> Any:
            logits = m(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            return torch.softmax(logits.float(), dim=-1).cpu()  # [batch, num_labels]

        probs = models.run(forward, _tensor_rows(close_scores(models.atol)))
        for row, i in enumerate(batch):
            p = probs[row].tolist()
            best = max(range(len(p)), key=lambda j: p[j])
            out[i] = {
                "label": labels[best],
                "scores": {label: round(p[j], 6) for j, label in enumerate(labels)},
            }
        tick(len(batch))
    return out  # type: ignore[return-value]


def predict_images(
    model: Any,
    pre: Any,
    rows: Sequence[dict[str, Any]],
    labels: Sequence[str],
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
) -> list[dict[str, Any]]:
    """Label and per-label probabilities of each image (the deterministic chain, in order)."""
    import torch

    from tunelab.lib.models.vision import pixels_for

    out = []
    models = as_models(model)
    for start in range(0, len(rows), batch_size):
        chunk = [pre.encode(r) for r in rows[start : start + batch_size]]
        stacked = torch.stack([e["pixel_values"] for e in chunk])  # [b, 3, H, W]

        def forward(m: Any, stacked: Any = stacked) -> Any:
            logits = m(pixel_values=pixels_for(m, stacked)).logits
            return torch.softmax(logits.float(), dim=-1).cpu()  # [batch, num_labels]

        probs = models.run(forward, _tensor_rows(close_scores(models.atol)))
        for p in probs.tolist():
            best = max(range(len(p)), key=lambda j: p[j])
            out.append(
                {
                    "label": labels[best],
                    "scores": {label: round(p[j], 6) for j, label in enumerate(labels)},
                }
            )
        tick(len(chunk))
    return out


def score_candidates(
    model: Any,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
) -> list[float]:
    """Summed log-likelihood of the loss positions of each (input_ids, labels) sequence.

    `labels` is -100 except on the target tokens (as in training). Sequences are left-padded so
    the targets sit at the end of every row, and only the last positions' logits are computed
    (`logits_to_keep`): the vocabulary projection of the prompt is never materialized.
    """
    import torch

    scores: list[float] = [0.0] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i][0]), i))
    models = as_models(model)
    device = models.device
    for batch in batches_of(order, batch_size):
        ids, mask = pad_sequences([sequences[i][0] for i in batch], pad_id, left=True)
        width = ids.shape[1]
        # target positions (in padded coordinates) of each row
        targets = []
        for i in batch:
            seq, lab = sequences[i]
            offset = width - len(seq)
            targets.append([(offset + t, seq[t]) for t, v in enumerate(lab) if v != -100 and t > 0])
        first = min((t for row in targets for t, _ in row), default=width - 1)
        keep = width - (first - 1)  # logits of positions first-1 .. width-1
        position_ids = left_padded_positions(mask)
        start = width - keep

        def forward(
            m: Any,
            ids: Any = ids,
            mask: Any = mask,
            position_ids: Any = position_ids,
            keep: int = keep,
            start: int = start,
            targets: list = targets,
        ) -> list:
            logits = m(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=position_ids.to(device),
                logits_to_keep=keep,
                use_cache=False,
            ).logits  # [batch, keep, vocab]
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            return [
                [float(sum(logp[row, t - 1 - start, tok] for t, tok in targets[row]))]
                for row in range(len(targets))
            ]

        found = models.run(forward, close_scores(models.atol))
        for row, i in enumerate(batch):
            scores[i] = found[row][0]
        tick(len(batch))
    return scores


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
    import torch

    from tunelab.core.env import cpu_share
    from tunelab.lib.preprocess.text import Preprocessor, check_template_match
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
    torch.manual_seed(ev.seed)
    was_training = model.training
    model.eval()
    timing: dict[str, Any] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    what = f"evaluate {split} ({len(rows)} examples)"
    tick = _Ticker(progress or None, len(rows), what)
    tick(0)  # a line at once in a pipe, before the first batch's minutes
    try:
        models = EvalModels.prepare(model, merge, merge_atol(cfg), ev.batch_size)
        with torch.inference_mode():
            predictions = predict_rows(
                models, tokenizer, pre, task, cfg, rows, architecture, tick, timing
            )
        merge_record = models.record
        del models  # the evaluation copy goes with it
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    metric_values = compute_metrics(task, predictions)
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
        "seconds": round(seconds, 3),
        "examples_per_s": round(len(rows) / seconds, 3) if seconds > 0 else None,
        "device": str(_device(model)),
        "torch_threads": torch.get_num_threads(),
        "cpu_s": round(cpu_s, 3),
        "cpu_share": cpu_share(cpu_s, seconds, torch.get_num_threads(), _device(model)),
        "evaluation": ev.model_dump(mode="json"),
        "metrics": metric_values,
        "generation": timing or None,
        "merge": merge_record,
    }
    return record, predictions


def merge_atol(cfg: StudyConfig) -> float:
    """How far a merged copy's scores may drift from the model's: verify's tolerance."""
    from tunelab.core.env import device_kind
    from tunelab.stages.train.precision import resolve_precision

    return SCORE_ATOL.get(resolve_precision(cfg.training.precision, device_kind()), 2e-4)


def predict_rows(
    model: Any,
    tokenizer: Any,
    pre: Any,
    task: Any,
    cfg: StudyConfig,
    rows: list[dict[str, Any]],
    architecture: str,
    tick: Callable[[int], None],
    timing: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Predict and judge `rows`: one prediction dict per row, in the order of `rows`.

    Classification scores the labels (an encoder head, or a causal LM's label likelihoods);
    other tasks generate with a causal LM and are judged by `judge_output`. `tick(n)` is called
    as rows finish; a generating task fills `timing` (`generation_timing`). Raises
    EvaluationError for a generative task on a non-causal model.
    """
    ev = cfg.evaluation
    pad_id = pad_id_for(tokenizer)
    if task.kind == "classification":
        labels = list(task.labels)
        if architecture == "encoder":
            encoded = [pre.encode(r) for r in rows]
            found = predict_encoder(model, encoded, labels, pad_id, ev.batch_size, tick)
        elif architecture == "image":
            found = predict_images(model, pre, rows, labels, ev.batch_size, tick)
        else:
            found = _score_labels(model, pre, rows, labels, pad_id, ev.batch_size, tick)
        out = []
        for r, f in zip(rows, found, strict=True):
            gold = task.label_of(r)
            out.append(
                {
                    "id": r["id"],
                    "gold": gold,
                    "raw_output": f["label"],
                    "prediction": f["label"],
                    "correct": f["label"] == gold,
                    "verdicts": {"correct": f["label"] == gold},
                    "scores": f["scores"],
                    # the stored image (`images/<sha256>.<ext>` in the snapshot): the dossier's
                    # thumbnails find it without opening the split files
                    **({"image": r["image"]} if architecture == "image" else {}),
                }
            )
        return out
    if architecture != "causal_lm":
        raise EvaluationError(
            f"a {task.kind} task needs a causal LM, the base model is an {architecture}",
            hint="set model.path to a causal LM (e.g. SmolLM2) in study.yaml",
        )
    # room for what generation may add, not for the gold answer (see Preprocessor.prompt_ids)
    prompts = [pre.prompt_ids(r, generate=ev.max_new_tokens) for r in rows]
    batches: list[dict[str, Any]] = []
    raw = generate_outputs(
        model,
        tokenizer,
        prompts,
        max_new_tokens=ev.max_new_tokens,
        batch_size=ev.batch_size,
        tick=tick,
        stats=batches,
        # the answer is the first JSON object: nothing after it is read
        stop_at_answer=task.kind == "extraction",
        draft_tokens=ev.draft_tokens,
    )
    if timing is not None:
        answers = [pre.target_len(r) for r in rows]
        timing.update(generation_timing(batches, answers, ev.max_new_tokens))
    return [judge_output(task, r, text) for r, text in zip(rows, raw, strict=True)]


def _score_labels(
    model: Any,
    pre: Any,
    rows: list[dict[str, Any]],
    labels: list[str],
    pad_id: int,
    batch_size: int,
    tick: Callable[[int], None],
) -> list[dict[str, Any]]:
    """Causal-LM classification: every (example, label) pair scored, argmax per example."""
    sequences = []
    for r in rows:
        candidates = pre.encode_candidates(r)  # one per label, in task.labels order
        sequences += [(enc["input_ids"], enc["labels"]) for enc in candidates]
    k = len(labels)
    done = [0]

    def per_pair(n: int) -> None:  # progress in examples, not pairs
        done[0] += n
        whole = done[0] // k
        if whole:
            tick(whole)
            done[0] -= whole * k

    scores = score_candidates(model, sequences, pad_id, max(1, batch_size), per_pair)
    out = []
    for e in range(len(rows)):
        s = scores[e * k : (e + 1) * k]
        best = max(range(k), key=lambda j: s[j])
        out.append(
            {"label": labels[best], "scores": {lab: round(s[j], 4) for j, lab in enumerate(labels)}}
        )
    return out


def judge_output(task: Any, row: dict[str, Any], raw_output: str) -> dict[str, Any]:
    """Parse one generated output and give its per-metric verdicts.

    Pure: the returned prediction row (id, gold, raw_output, prediction, verdicts, ...) depends
    only on the task, the gold row and the text.
    """
    parsed = task.parse(raw_output)
    value = parsed.get("value")
    if task.kind == "extraction":
        gold = task.gold(row)
        verdicts = task.verdicts(parsed, row)
        correct = verdicts["correct"]
    else:
        task_verdicts = task.verdicts(parsed, row)
        json_schema = getattr(task, "json_schema", None) is not None
        gold = task.target_text(row)
        correct = bool(parsed.get("valid"))
        verdicts = {
            "format_valid": correct,
            "json_valid": bool(parsed.get("json_valid")) if json_schema else None,
            "schema_valid": bool(parsed.get("valid")) if json_schema else None,
            "exact_match": bool(task_verdicts.get("exact_match")),
            "failure": parsed.get("failure"),
        }
    return {
        "id": row["id"],
        "gold": gold,
        "raw_output": raw_output,
        "prediction": value,
        "correct": correct,
        "verdicts": verdicts,
        "parse_error": parsed.get("error"),
    }


def rescore_predictions(task: Any, predictions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prediction rows judged again from their recorded gold and raw output by the current
    rules (`judge_output` is pure): how records scored by an earlier scorer are compared."""
    return [
        judge_output(task, {"id": p["id"], "target": p["gold"]}, p.get("raw_output") or "")
        for p in predictions
    ]


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
        if row.kind == BASELINE_KIND:
            model, tokenizer, base = load_base_model(study, labels)
        else:
            from tunelab.stages.train import load_run_model

            model, tokenizer, base = load_run_model(study, target)
        load_s = time.perf_counter() - started
        trained_with = target.path("preprocess.json")
        record, predictions = evaluate_model(
            model,
            tokenizer,
            base,
            study,
            examples,
            split,
            labels=labels,
            progress=progress,
            expect_template_sha256=read_json(trained_with).get("template_sha256")
            if trained_with.exists()
            else None,
        )
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
