"""`tunelab verify`: a checkpoint reloaded in a fresh process must reproduce its recorded predictions.

What is checked, in order:

1. the files of the run's final checkpoint against the sha256 recorded in its state.json (an
   edited adapter is caught here, before anything is loaded);
2. a new Python process (`python -m tunelab.stages.verify.stage SPEC`) loads the base and the checkpoint from
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
when the run cannot be verified. `fresh_evaluate(study, run_id, snapshot=, split=, ids=,
labels=, probe_ids=None, val_loss_ids=None, num_threads=None, merge=None)` (`merge`: the
recorded choice, `recorded_copy(eval_record)`) runs the worker and returns its predictions,
timings and `env`; its TunelabError is raised again as its kind, any other failure as
CheckpointError with the child's whole error. The parent imports no torch. `probe_logits` works
on pixel values for an image model.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.env import platform_of
from tunelab.core.errors import CheckpointError, EvaluationError, ModelError, RunError
from tunelab.core.records import read_json, read_jsonl, write_json_atomic
from tunelab.core.worker import Worker, serve
from tunelab.lib.inference.eval_copy import ran_on_copy
from tunelab.stages.evaluate.stage import SCORE_ATOL
from tunelab.stages.train.checkpoint import check_checkpoint_files

if TYPE_CHECKING:
    from tunelab.core.study import Run, Study
    from tunelab.lib.models import BaseModel
    from tunelab.stages.data import Snapshot

# Raw logits of the smoke probe are compared unrounded.
LOGIT_ATOL = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-2}
SHOWN_MISMATCHES = 10


class VerifyFailed(CheckpointError):
    """The reloaded checkpoint did not reproduce the recorded predictions (exit code 1)."""

    exit_code = 1


VERIFIABLE_KINDS = ("train", "smoke", "eval", "baseline")


# ---------------------------------------------------------------- pure comparisons


def _score_diff(recorded: Any, fresh: Any) -> float:
    """Largest absolute difference between two {label: score} maps (inf when keys differ)."""
    if recorded is None and fresh is None:
        return 0.0
    if not isinstance(recorded, Mapping) or not isinstance(fresh, Mapping):
        return math.inf
    if set(recorded) != set(fresh):
        return math.inf
    diffs = [abs(float(recorded[k]) - float(fresh[k])) for k in recorded]
    return max(diffs, default=0.0)


def compare_predictions(
    recorded: Sequence[Mapping[str, Any]],
    fresh: Sequence[Mapping[str, Any]],
    *,
    atol: float,
) -> dict[str, Any]:
    """Match prediction rows by id: prediction, raw output and correctness must be identical,
    scores (where recorded) within `atol`.

    Returns {n, matched, mismatched, missing, max_score_diff, atol, mismatches: [first few
    {id, field, recorded, fresh}], ok}.
    """
    fresh_by_id = {r["id"]: r for r in fresh}
    mismatches: list[dict[str, Any]] = []
    missing = []
    max_diff = 0.0
    bad_ids: set[Any] = set()
    for rec in recorded:
        new = fresh_by_id.get(rec["id"])
        if new is None:
            missing.append(rec["id"])
            bad_ids.add(rec["id"])
            continue
        for field in ("prediction", "raw_output", "correct"):
            if rec.get(field) != new.get(field):
                bad_ids.add(rec["id"])
                mismatches.append(
                    {
                        "id": rec["id"],
                        "field": field,
                        "recorded": rec.get(field),
                        "fresh": new.get(field),
                    }
                )
        if "scores" in rec or "scores" in new:
            diff = _score_diff(rec.get("scores"), new.get("scores"))
            max_diff = max(max_diff, diff)
            if diff > atol:
                bad_ids.add(rec["id"])
                mismatches.append(
                    {
                        "id": rec["id"],
                        "field": "scores",
                        "recorded": rec.get("scores"),
                        "fresh": new.get("scores"),
                        "max_abs_diff": diff,
                    }
                )
    n = len(recorded)
    return {
        "n": n,
        "matched": n - len(bad_ids),
        "mismatched": len(bad_ids),
        "missing": missing[:SHOWN_MISMATCHES],
        "max_score_diff": max_diff if math.isfinite(max_diff) else None,
        "atol": atol,
        "mismatches": mismatches[:SHOWN_MISMATCHES],
        "ok": not bad_ids and n > 0,
    }


def _devices(env: Mapping[str, Any]) -> list[str]:
    gpus = env.get("gpus") or []
    if gpus:
        return [str(g.get("name")) for g in gpus]
    return [str((env.get("cpu") or {}).get("name"))]


def compare_env(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[dict]:
    """What differs between a run's env.json and this process's environment, among what changes
    numerics: torch, backend, the device computed on, CUDA/ROCm versions, device names, transformers and peft."""
    if not recorded:
        return [{"field": "env.json", "recorded": None, "current": "present"}]

    def pkg(env: Mapping[str, Any], name: str) -> Any:
        return (env.get("packages") or {}).get(name)

    fields = {
        "torch": lambda e: e.get("torch"),
        "backend": lambda e: e.get("backend"),
        # a record without compute_device computed where its backend was
        "compute_device": lambda e: e.get("compute_device", e.get("backend")),
        "cuda": lambda e: e.get("cuda"),
        "rocm": lambda e: e.get("rocm"),
        "devices": _devices,
        "transformers": lambda e: pkg(e, "transformers"),
        "peft": lambda e: pkg(e, "peft"),
    }
    out = []
    for name, get in fields.items():
        a, b = get(recorded), get(current)
        if a != b:
            out.append({"field": name, "recorded": a, "current": b})
    return out


def env_message(run_id: str, differences: Sequence[Mapping[str, Any]]) -> str | None:
    if not differences:
        return None
    what = ", ".join(f"{d['field']} {d['recorded']} -> {d['current']}" for d in differences)
    return (
        f"this environment differs from run {run_id}'s ({what}): outputs may legitimately "
        "differ on a new platform; re-run `tunelab smoke` and `tunelab baseline` here before "
        "trusting or comparing results made on it"
    )


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


def _reevaluate(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """The fresh process's body: load, re-evaluate, write predictions (and probe logits);
    returns its timings, metrics and environment."""
    import torch
    from safetensors.torch import save_file

    from tunelab.core.env import capture_env
    from tunelab.core.records import write_jsonl_atomic
    from tunelab.core.study import Study
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.evaluate.stage import evaluate_model

    if spec.get("num_threads"):
        torch.set_num_threads(int(spec["num_threads"]))
    study = Study.open(spec["study"], spec.get("overrides") or [])
    run = study.get_run(spec["run"])
    snapshot = load_snapshot(study, spec["snapshot"])
    rows = select_rows(snapshot, spec["split"], spec["ids"])
    labels = spec.get("labels")
    started = time.perf_counter()
    model, tokenizer, base = load_for_evaluation(study, run, labels)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    record, predictions = evaluate_model(
        model, tokenizer, base, study, rows, spec["split"], labels=labels, merge=spec.get("merge")
    )
    eval_s = time.perf_counter() - started
    write_jsonl_atomic(out / "predictions.jsonl", predictions)
    started = time.perf_counter()  # the smoke's extra checks, apart from the evaluation
    if spec.get("probe_ids"):
        probe_rows = select_rows(snapshot, spec["split"], spec["probe_ids"])
        logits = probe_logits(model, tokenizer, base, study, probe_rows, labels)
        save_file({"logits": logits}, str(out / "probe.safetensors"))
    val_loss = None
    if spec.get("val_loss_ids"):
        from tunelab.stages.train.validation import validation_loss_of

        run_cfg = run.config
        val_rows = select_rows(snapshot, spec["split"], spec["val_loss_ids"])
        val_loss = validation_loss_of(model, tokenizer, base, run_cfg, val_rows, labels)
    checks_s = time.perf_counter() - started
    return {
        "load_s": round(load_s, 3),
        "eval_s": round(eval_s, 3),
        "checks_s": round(checks_s, 3),
        "val_loss": val_loss,
        "metrics": record["metrics"],
        "spec_sha256": record["spec_sha256"],
        "merge": record["merge"],
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
    with Worker("tunelab.stages.verify.stage") as worker:
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


# ---------------------------------------------------------------- the stage


def _target_of(study: Study, run: Run) -> tuple[Run, dict[str, Any] | None]:
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
        return target, {"eval_run": row.id, "dir": run.dir, "record": read_json(own)}
    return run, find_evaluation(study, row.id, "validation")


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


def recorded_copy(eval_record: Mapping[str, Any]) -> bool:
    """Whether the recorded evaluation ran on its evaluation copy (`tunelab.lib.inference.eval_copy`; a
    record without `merge` ran on the model as loaded)."""
    return ran_on_copy(eval_record.get("merge"))


def _reproduce(
    study: Study,
    model_run: str,
    record: Mapping[str, Any],
    recorded: list[dict[str, Any]],
    eval_record: Mapping[str, Any],
    atol: float,
) -> dict[str, Any]:
    """Re-evaluate in a fresh process and compare: {predictions, timings, passed, reason}.

    A checkpoint or base model the new process cannot load is a failed verification; a study
    that cannot evaluate at all (hypothesis drifted, snapshot gone) raises.
    """
    try:
        fresh = fresh_evaluate(
            study,
            model_run,
            snapshot=record["data_snapshot"],
            split=record["split"],
            ids=[r["id"] for r in recorded],
            labels=eval_record.get("labels"),
            num_threads=eval_record.get("torch_threads"),
            merge=recorded_copy(eval_record),
        )
    except (CheckpointError, ModelError) as exc:
        return {
            "predictions": None,
            "passed": False,
            "reason": f"the checkpoint could not be reloaded: {exc.message}",
        }
    cmp = compare_predictions(recorded, fresh["predictions"], atol=atol)
    out: dict[str, Any] = {
        "predictions": cmp,
        "timings": {k: fresh[k] for k in ("load_s", "eval_s", "process_s")},
        "fresh_spec_sha256": fresh["spec_sha256"],
        "fresh_env": fresh.get("env"),
        "passed": cmp["ok"],
    }
    if cmp["ok"]:
        out["reason"] = (
            f"{cmp['n']} recorded predictions reproduced in a fresh process "
            f"(max score difference {cmp['max_score_diff']:.2g}, atol {atol:g})"
        )
    else:
        first = cmp["mismatches"][0] if cmp["mismatches"] else {"id": cmp["missing"][:1]}
        out["reason"] = (
            f"{cmp['mismatched']} of {cmp['n']} recorded predictions not reproduced "
            f"(first: example {first.get('id')!r}, {first.get('field', 'missing')})"
        )
    return out


def _used_precision(requested: str, compute_json: Path) -> str:
    """The precision a run trained in: its compute.json's, else `requested` resolved here."""
    from tunelab.core.env import device_kind
    from tunelab.stages.train.precision import resolve_precision

    if compute_json.exists():
        return read_json(compute_json)["precision"]["used"]
    return resolve_precision(requested, device_kind())


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
    recorded = load_predictions(evaluation)
    eval_record = evaluation["record"]
    precision = study.config.training.precision
    if trow.kind != "baseline":
        precision = target.record.training.get("precision", precision)
    precision = _used_precision(precision, target.dir / "compute.json")
    atol = SCORE_ATOL.get(precision, 2e-4) if atol is None else atol
    started = time.perf_counter()
    record: dict[str, Any] = {
        "run_id": run.id,
        "model_run": trow.id,
        "model_kind": trow.kind,
        "evaluation_run": evaluation["eval_run"],
        "split": eval_record.get("split", "validation"),
        "data_snapshot": eval_record.get("data_snapshot") or trow.data_snapshot,
        "spec_sha256": eval_record.get("spec_sha256"),
        "started_at": utc_now(),
    }

    # 1. checkpoint files
    if trow.kind == "baseline":
        record["checkpoint"] = None
    else:
        ckpt = _checkpoint_of(target)
        if ckpt is None:
            record["checkpoint"] = {"path": None, "ok": False, "changed": [], "missing": ["all"]}
        else:
            record["checkpoint"] = check_checkpoint_files(ckpt)

    # 2. the fresh process
    ck = record["checkpoint"]
    if ck is not None and not ck["ok"] and ck.get("damaged") and not ck["changed"] + ck["missing"]:
        record.update(
            predictions=None,
            passed=False,
            reason=f"checkpoint {ck['path']} cannot be loaded: "
            + "; ".join(f"{n}: {why}" for n, why in ck["damaged"].items()),
        )
    elif ck is not None and not ck["ok"]:
        bad = ck["changed"] + ck["missing"]
        record.update(
            predictions=None,
            passed=False,
            reason=f"checkpoint {ck['path']} does not match the sha256 recorded when it was "
            "written: "
            + ", ".join(f"{n} ({'changed' if n in ck['changed'] else 'missing'})" for n in bad),
        )
    else:
        record.update(_reproduce(study, trow.id, record, recorded, eval_record, atol))

    # 3. environment (recorded whatever the outcome): the fresh process's own, which is the one
    # that re-evaluated; this process's where none ran (it then imports torch for it)
    current_env = record.pop("fresh_env", None) or capture_env()
    env_path = target.dir / "env.json"
    differences = compare_env(read_json(env_path) if env_path.exists() else None, current_env)
    record["environment"] = {
        "same": not differences,
        "differences": differences,
        "message": env_message(trow.id, differences),
        "torch": current_env["torch"],
        "backend": current_env["backend"],
        "devices": _devices(current_env),
        "platform": platform_of(current_env),  # the dossier's platforms section
    }
    if not record["passed"] and differences:
        record["reason"] += "; the environment differs from the run's (see environment)"
    record["seconds"] = round(time.perf_counter() - started, 3)
    record["finished_at"] = utc_now()
    path = _write_record(run, record)
    record["path"] = str(path)
    study.ledger.add_event(
        run.id,
        "verify",
        {"record": path.name, "passed": record["passed"], "reason": record["reason"][:300]},
    )
    return record


if __name__ == "__main__":
    sys.exit(serve(_reevaluate))
