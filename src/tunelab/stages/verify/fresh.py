"""The fresh process of verify and smoke: `python -m tunelab.stages.verify.fresh SPEC` loads the
base and the checkpoint from disk (`tunelab.stages.train.load_run_model`, the same loader
evaluation uses), re-evaluates the examples with the study's evaluation procedure and writes
its predictions.

`fresh_evaluate(study, run_id, *, snapshot, split, ids, labels=, probe_ids=None,
val_loss_ids=None, num_threads=None, merge=None)` (`merge`: the recorded choice,
`recorded_copy(eval_record)`) runs the worker and returns its predictions, timings and `env`;
its TunelabError is raised again as its kind, any other failure as CheckpointError with the
child's whole error. The parent imports no torch. `probe_logits` works on pixel values for an
image model.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import CheckpointError, EvaluationError
from tunelab.core.record_checks import FreshSpec
from tunelab.core.records import read_jsonl
from tunelab.core.worker import Worker, serve

if TYPE_CHECKING:
    from tunelab.core.study import Run, Study
    from tunelab.lib.models import BaseModel
    from tunelab.stages.data import Snapshot


# ---------------------------------------------------------------- the fresh process


def _probe_batch(
    model: Any,
    tokenizer: Any,
    base: BaseModel,
    study: Study,
    rows: list[dict],
    labels: Sequence[str] | None,
):
    """Inputs of the logit probe: the evaluation's own encoding of `rows`, padded.

    encoder: right padding, logits [batch, num_labels]; causal LM: the inference prompts, left
    padding, logits of the last position [batch, vocab].
    """
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.stage import pad_id_for, pad_sequences

    task = get_task(study.config, list(labels) if labels else None)
    pre = Preprocessor(tokenizer, study.config, task, base.architecture)
    left = base.architecture == "causal_lm"
    seqs = [pre.prompt_ids(r) for r in rows]
    ids, mask = pad_sequences(seqs, pad_id_for(tokenizer), left=left)
    return ids, mask


def _image_batch(processor: Any, study: Study, rows: list[dict], labels: Sequence[str] | None):
    """pixel_values [batch, 3, H, W] of `rows`, the evaluation's deterministic chain."""
    import torch

    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    task = get_task(study.config, list(labels) if labels else None)
    pre = Preprocessor(processor, study.config, task, "image")
    return torch.stack([pre.encode(r)["pixel_values"] for r in rows])


def probe_logits(
    model: Any,
    tokenizer: Any,
    base: BaseModel,
    study: Study,
    rows: list[dict],
    labels: Sequence[str] | None,
):
    """Raw fp32 logits of `model` on `rows` (see `_probe_batch`), for exact reload checks."""
    import torch

    from tunelab.lib.inference.decoding import left_padded_positions

    device = next(model.parameters()).device
    if base.architecture == "image":
        kwargs: dict[str, Any] = {"pixel_values": _image_batch(tokenizer, study, rows, labels)}
    else:
        ids, mask = _probe_batch(model, tokenizer, base, study, rows, labels)
        kwargs = {"input_ids": ids, "attention_mask": mask}
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    if base.architecture == "image":
        from tunelab.lib.models.vision import pixels_for

        kwargs["pixel_values"] = pixels_for(model, kwargs["pixel_values"])
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if base.architecture == "causal_lm":
                kwargs["position_ids"] = left_padded_positions(mask).to(device)
                kwargs["use_cache"] = False
                kwargs["logits_to_keep"] = 1
            logits = model(**kwargs).logits.float().cpu()
    finally:
        model.train(was_training)
    return logits.reshape(logits.shape[0], -1).contiguous()  # [batch, labels or vocab]


def select_rows(snapshot: Snapshot, split: str, ids: Sequence[Any]) -> list[dict[str, Any]]:
    """The snapshot rows of `split` with these ids, in this order."""
    if split != "validation":
        raise EvaluationError(
            f"verification re-evaluates recorded {split} predictions only on the validation split",
            hint="the sealed test split is not reopened for verification",
        )
    by_id = {r["id"]: r for r in snapshot.rows(split)}
    absent = [i for i in ids if i not in by_id]
    if absent:
        raise EvaluationError(
            f"{len(absent)} recorded example(s) are not in snapshot {snapshot.id} "
            f"(e.g. {absent[:3]})",
            hint="the predictions were recorded on another data snapshot",
        )
    return [by_id[i] for i in ids]


def load_for_evaluation(study: Study, run: Run, labels: list[str] | None):
    """(model, tokenizer, base) as evaluation loads them: the untouched base for a baseline,
    else the run's final checkpoint through `tunelab.stages.train.load_run_model`."""
    import torch

    if run.row.kind == "baseline":
        from tunelab.stages.evaluate.stage import load_base_model

        torch.manual_seed(
            study.config.evaluation.seed
        )  # as the baseline's evaluation seeds a new head
        return load_base_model(study, labels)
    from tunelab.stages.train import load_run_model

    return load_run_model(study, run)


def _reevaluate(raw: dict[str, Any], out: Path) -> dict[str, Any]:
    """The fresh process's body: load, re-evaluate, write predictions (and probe logits);
    returns its timings, metrics and environment."""
    import torch
    from safetensors.torch import save_file

    from tunelab.core.env import capture_env
    from tunelab.core.record_types import Evaluation
    from tunelab.core.records import write_jsonl_atomic
    from tunelab.core.study import Study
    from tunelab.core.worker import SPEC
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.evaluate.stage import evaluate_model

    spec = FreshSpec.of(out / SPEC, raw)
    if spec.num_threads:
        torch.set_num_threads(int(spec.num_threads))
    study = Study.open(spec.study, spec.overrides or [])
    run = study.get_run(spec.run)
    snapshot = load_snapshot(study, spec.snapshot)
    rows = select_rows(snapshot, spec.split, spec.ids)
    labels = spec.labels
    started = time.perf_counter()
    model, tokenizer, base = load_for_evaluation(study, run, labels)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    raw_record, predictions = evaluate_model(
        model, tokenizer, base, study, rows, spec.split, labels=labels, merge=spec.merge
    )
    eval_s = time.perf_counter() - started
    record = Evaluation.of(out / f"metrics-{spec.split}.json", raw_record)
    write_jsonl_atomic(out / "predictions.jsonl", predictions)
    started = time.perf_counter()  # the smoke's extra checks, apart from the evaluation
    if spec.probe_ids:
        probe_rows = select_rows(snapshot, spec.split, spec.probe_ids)
        logits = probe_logits(model, tokenizer, base, study, probe_rows, labels)
        save_file({"logits": logits}, str(out / "probe.safetensors"))
    val_loss = None
    if spec.val_loss_ids:
        from tunelab.stages.train.validation import validation_loss_of

        run_cfg = run.config
        val_rows = select_rows(snapshot, spec.split, spec.val_loss_ids)
        val_loss = validation_loss_of(model, tokenizer, base, run_cfg, val_rows, labels)
    checks_s = time.perf_counter() - started
    return {
        "load_s": round(load_s, 3),
        "eval_s": round(eval_s, 3),
        "checks_s": round(checks_s, 3),
        "val_loss": val_loss,
        "metrics": record.metrics,
        "spec_sha256": record.spec_sha256,
        "merge": record.merge,
        "base_identity_sha256": base.identity.get("sha256"),
        "pid": os.getpid(),
        "env": capture_env(),
    }


def fresh_evaluate(
    study: Study,
    run_id: str,
    *,
    snapshot: str,
    split: str,
    ids: Sequence[Any],
    labels: Sequence[str] | None,
    probe_ids: Sequence[Any] | None = None,
    val_loss_ids: Sequence[Any] | None = None,
    num_threads: int | None = None,
    merge: bool | None = None,
    timeout_s: float = 3600,
) -> dict[str, Any]:
    """Re-evaluate run `run_id` on the examples `ids` in a new Python process.

    `num_threads`: the caller's torch thread count when it computed the figures compared
    (a different count reorders float sums); by default the run's training.num_threads.
    `merge`: the recorded evaluation's choice (its copy or not) to reproduce; None lets the
    fresh process check and choose as an evaluation does.

    `probe_ids`: also the raw logits on these examples (`probe_logits`); `val_loss_ids`: also
    the training loop's validation loss on these examples, with the run's own config.
    Returns {predictions, load_s, eval_s, checks_s (the probe and validation loss), process_s,
    metrics, probe_logits (a tensor or None), val_loss (or None), pid, env (the fresh
    process's capture_env)}. Raises the child's TunelabError again (its kind), or
    CheckpointError with the child's whole error when it fails otherwise.
    """
    spec = {
        "study": str(study.root),
        "overrides": list(study.overrides),
        "run": run_id,
        "snapshot": snapshot,
        "split": split,
        "ids": list(ids),
        "labels": list(labels) if labels else None,
        "probe_ids": list(probe_ids) if probe_ids else None,
        "val_loss_ids": list(val_loss_ids) if val_loss_ids else None,
        "num_threads": num_threads or study.config.training.num_threads,
        "merge": merge,
    }
    with Worker("tunelab.stages.verify.fresh") as worker:
        outcome = worker.run(spec, timeout_s=timeout_s)
        result = outcome.value(
            CheckpointError,
            f"in the fresh process re-evaluating run {run_id}",
            hint="the checkpoint or the base model cannot be loaded on its own; the error "
            "above names the file",
        )
        result["predictions"] = read_jsonl(worker.dir / "predictions.jsonl")
        probe = worker.dir / "probe.safetensors"
        result["probe_logits"] = None
        if probe.exists():
            from safetensors.torch import load_file  # torch: only the smoke's probe needs it

            result["probe_logits"] = load_file(str(probe))["logits"]
        result["process_s"] = round(outcome.seconds, 3)
    return result


if __name__ == "__main__":
    sys.exit(serve(_reevaluate))
