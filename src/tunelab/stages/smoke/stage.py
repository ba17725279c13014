"""`tunelab smoke`: a few examples through the whole training and evaluation loop, then a reload.

A run of kind `smoke` takes the study's config with a few overrides (2 optimizer steps, a micro
batch that fits 8 training examples, the validation loss at the last step) and a seeded sample
of the snapshot (8 training, 4 validation examples). It runs the real training code
(`tunelab.stages.train.stage`: the loop, the update check, the atomic checkpoint), the real evaluation
(`tunelab.stages.evaluate.stage.evaluate_model` on the model loaded back from the checkpoint, as `tunelab
eval` does), then a new Python process (`tunelab.stages.verify.fresh`) that reloads the checkpoint from disk
and must give:

- the same predictions and raw outputs, scores within the recorded rounding;
- the same logits on the evaluation examples (atol 1e-5 in fp32);
- the same validation loss as the live model had at the last step (relative 1e-5 in fp32).

The pass/fail table and the timings the planner reads (`step_s`, `eval_s_per_example`,
`checkpoint_save_s`, `reload_s`, ...) are written to `records/runs/<smoke-id>/smoke.json`.

`run(study, *, num_train=8, num_steps=2, num_eval=4, progress=None) -> (run, record)`
(`progress`: core.progress, moved by the training steps) builds its run with
`tunelab.stages.train.stage.prepare_run` (its `Prepared.snapshot` replaced by a seeded
`SnapshotSample`) and `execute_run`. `records/runs/<smoke-id>/smoke.json` (what `tunelab plan`
reads): `passed`, `reason`, `checks [{check, ok, detail}]`, `step_s` (mean of the steps after the
first), `first_step_s`, `tokens_per_step`, `peak_memory_bytes`, `train_s`, `eval_s`,
`eval_s_per_example`, `checkpoint_save_s` (state.json's `save_s` when training recorded one,
else file times), `checkpoint_bytes`, `reload_s`, `fresh_eval_s`, `fresh_checks_s`,
`fresh_process_s` (with imports), `adapter_time_ratio` (`tunelab.lib.probes.adapter_time_ratio`:
the fastest of 3 to 5 interleaved pairs, per decoding step over `RATIO_DECODE_STEPS` new tokens
for a generating task; None without an adapter), `adapter_timing` (`unit`, `pairs`, `off_s`,
`on_s`, `decode_steps`), `total_s`, `settings` (num_train, num_steps, num_eval, overrides,
micro_batch_size, grad_accum_steps, max_seq_len, precision, method, architecture, device,
torch_threads, load_avg_1m, logical_cores), `losses`. A failed check raises `SmokeFailed`
(exit 1) after the record is written.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import RunError, TunelabError
from tunelab.core.record_checks import FreshOutcome
from tunelab.core.record_smoke import SmokeCheck, UpdateCheck, update_check_of
from tunelab.core.record_types import Evaluation, RunStatus
from tunelab.core.records import read_json, read_jsonl, write_json_atomic
from tunelab.core.run_parts import CheckpointCheck, Prediction, Reproduced, TrainStep
from tunelab.lib.probes import AdapterPass, adapter_time_ratio

if TYPE_CHECKING:
    from tunelab.core.progress import Progress
    from tunelab.core.study import Run, Study
    from tunelab.stages.train.stage import Prepared

SMOKE_KIND = "smoke"
VAL_LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}


class SmokeFailed(RunError):
    """A smoke check failed (exit code 1); smoke.json says which."""

    exit_code = 1


@dataclass
class SnapshotSample:
    """A seeded sample of a snapshot's train and validation rows; same id, labels, manifest."""

    snapshot: Any
    sizes: dict[str, int]
    seed: int

    @property
    def id(self) -> str:
        return self.snapshot.id

    @property
    def labels(self) -> Any:
        return self.snapshot.labels

    @property
    def manifest(self) -> Any:
        return self.snapshot.manifest

    def rows(self, split: str) -> list[dict[str, Any]]:
        rows = self.snapshot.rows(split)
        n = self.sizes.get(split)
        if n is None or n >= len(rows):
            return rows
        keep = sorted(random.Random(f"{self.seed}:{split}").sample(range(len(rows)), n))
        return [rows[i] for i in keep]


def smoke_overrides(cfg: Any, num_train: int, num_steps: int) -> list[str]:
    """--set overrides of a smoke run: `num_steps` steps that together take `num_train` examples
    (the study's accumulation kept where it fits), the validation loss at the last step, one
    checkpoint at the end, the update check within the steps."""
    t = cfg.training
    per_step = max(1, math.ceil(num_train / num_steps))
    accum = max(1, min(t.grad_accum_steps, per_step))
    micro = max(1, math.ceil(per_step / accum))
    return [
        f"training.max_steps={num_steps}",
        f"training.micro_batch_size={micro}",
        f"training.grad_accum_steps={accum}",
        f"training.eval_every_steps={num_steps}",
        "training.checkpoint_every_steps=null",
        f"training.update_check_steps={min(t.update_check_steps, num_steps)}",
    ]


def _checkpoint_save_s(run: Any, ckpt: Path) -> float | None:
    """Seconds the final checkpoint took to write: its recorded duration when the training code
    records one, else from the file times (last metrics line -> the checkpoint's DONE marker)."""
    state = read_json(ckpt / "state.json")
    for key in ("save_s", "checkpoint_save_s", "seconds"):
        if isinstance(state.get(key), (int, float)):
            return round(float(state[key]), 3)
    metrics, done = run.path("metrics.jsonl"), ckpt / "DONE"
    if not (metrics.exists() and done.exists()):
        return None
    return round(max(0.0, (done.stat().st_mtime_ns - metrics.stat().st_mtime_ns) / 1e9), 3)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _check(name: str, ok: bool | None, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": ok, "detail": detail}


def _run_settings(cfg: Any, prep: Prepared) -> dict[str, Any]:
    """What the smoke's timings were measured under."""
    import torch

    from tunelab.core.env import device_kind

    return {
        "micro_batch_size": cfg.training.micro_batch_size,
        "grad_accum_steps": cfg.training.grad_accum_steps,
        "max_seq_len": cfg.preprocess.max_seq_len,
        "precision": cfg.training.precision,
        "method": cfg.adaptation.method,
        "architecture": prep.base.architecture,
        "device": device_kind(),  # the kind only: no CUDA context in this process for it
        "torch_threads": torch.get_num_threads(),
        # timings taken on a busy machine are slower than the hardware: say how busy it was
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "logical_cores": os.cpu_count(),
    }


def _record(study: Study, run: Run, record: dict[str, Any], checks: list[dict[str, Any]]) -> None:
    """Judge the checks, write smoke.json, and fail the run when a check failed."""
    path = run.path("smoke.json")
    passed, reason = _verdict(
        [SmokeCheck.of(path, c, f"checks[{i}]") for i, c in enumerate(checks)]
    )
    record["passed"], record["reason"] = passed, reason
    write_json_atomic(path, record)
    record["path"] = str(path)
    if run.row.status == "completed" and not passed:
        run.set_status("failed", f"smoke: {reason}"[:500])
    elif run.row.status == "running":
        run.set_status("failed", f"smoke: {reason}"[:500])
    study.ledger.add_event(run.id, "smoke", {"passed": passed, "path": str(path)})


def _verdict(checks: list[SmokeCheck]) -> tuple[bool, str]:
    """(passed, reason): passed when there are checks and none failed."""
    failed = [c for c in checks if c.ok is False]
    passed = bool(checks) and not failed
    if passed:
        return True, "every check passed"
    return False, "; ".join(f"{c.check}: {c.detail}" for c in failed)[:1000]


def run(
    study: Study,
    *,
    num_train: int = 8,
    num_steps: int = 2,
    num_eval: int = 4,
    progress: Progress | None = None,
) -> tuple[Run, dict[str, Any]]:
    """`tunelab smoke`: returns (run, record); record["passed"] says whether every check passed.

    Raises the usual TunelabErrors before the run exists (no hypothesis, no snapshot, no model)
    and RunInterrupted on a signal; a failure inside the run is a failed check in the record.
    """

    from tunelab.core.env import capture_env
    from tunelab.core.study import Study
    from tunelab.stages.train import stage as train_stage

    if num_steps < 1 or num_train < 1 or num_eval < 1:
        raise RunError(
            "smoke needs at least 1 step, 1 training and 1 evaluation example",
            hint="e.g. tunelab smoke --steps 2 --train-examples 8 --eval-examples 4",
        )
    from tunelab.stages.evaluate.stage import require_generation_room

    require_generation_room(study.config)
    overrides = smoke_overrides(study.config, num_train, num_steps)
    # the smoke's own settings replace the user's --set of the same keys
    own = {item.split("=", 1)[0] for item in overrides}
    kept = [item for item in study.overrides if item.split("=", 1)[0].strip() not in own]
    smoke_study = Study.open(study.root, kept + overrides)
    prep = train_stage.prepare_run(smoke_study)
    sample = SnapshotSample(
        prep.snapshot,
        {"train": num_train, "validation": num_eval},
        smoke_study.config.training.seed,
    )
    prep.snapshot = sample
    train_ids = [r["id"] for r in sample.rows("train")]
    eval_rows = sample.rows("validation")
    eval_ids = [r["id"] for r in eval_rows]
    settings = {
        "num_train": len(train_ids),
        "num_steps": num_steps,
        "num_eval": len(eval_ids),
        "overrides": overrides,
        **_run_settings(smoke_study.config, prep),
    }
    run = smoke_study.create_run(
        SMOKE_KIND,
        config=smoke_study.config,
        name="smoke",
        why="a few examples through training, evaluation and a fresh-process reload",
        data_snapshot=sample.id,
        hypothesis=prep.hypothesis,
        env=capture_env(),
        extra={
            "labels": prep.labels,
            "base_model": prep.base.identity,
            "hypothesis_evaluation_spec_sha256": prep.hypothesis["evaluation_spec_sha256"],
            "smoke": {**settings, "train_ids": train_ids, "eval_ids": eval_ids},
        },
    )
    found = _Findings([], {}, {"run_id": run.id, "settings": settings})
    checks, timings, record = found.checks, found.timings, found.record
    started = time.perf_counter()
    try:
        _smoke_body(smoke_study, run, prep, eval_rows, eval_ids, found, progress)
    except TunelabError as exc:
        if getattr(exc, "exit_code", 2) >= 128:  # interrupted by a signal: stop here
            raise
        found.check("smoke", False, f"{type(exc).__name__}: {exc.message}")
        record["hint"] = exc.hint
    record["checks"] = checks
    record.update(timings)
    record["total_s"] = round(time.perf_counter() - started, 3)
    _record(study, run, record, checks)
    return run, record


def _adapter_pass(
    model: Any, tokenizer: Any, base: Any, study: Study, rows: list[dict[str, Any]], labels: Any
) -> AdapterPass:
    """The smoke's examples as the planner's adapter probe times them: one batch of the
    evaluation's prompts generated for a generating task, the evaluation itself otherwise."""
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.stage import _task_labels, evaluate_model, generate_outputs

    cfg = study.config
    task = get_task(cfg, _task_labels(study, labels))
    if task.kind == "classification":

        def evaluation_s() -> float | None:
            found, _ = evaluate_model(
                model, tokenizer, base, study, rows, "validation", labels=labels
            )
            return _timed_evaluation(found).seconds

        return AdapterPass(model, evaluation_s=evaluation_s)
    ev = cfg.evaluation
    pre = Preprocessor(tokenizer, cfg, task, base.architecture)
    prompts = [pre.prompt_ids(r, generate=ev.max_new_tokens) for r in rows[: ev.batch_size]]

    def decode(budget: int) -> list[dict[str, Any]]:
        stats: list[dict[str, Any]] = []
        generate_outputs(
            model, tokenizer, prompts, max_new_tokens=budget, batch_size=len(prompts), stats=stats
        )
        return stats

    return AdapterPass(model, decode=decode, max_new_tokens=ev.max_new_tokens)


@dataclass
class _Findings:
    """What the smoke records as it goes: the checks in order, the timings, the other fields."""

    checks: list[dict[str, Any]]
    timings: dict[str, Any]
    record: dict[str, Any]

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(_check(name, ok, detail))


def _smoke_body(
    study: Study,
    run: Run,
    prep: Prepared,
    eval_rows: list[dict[str, Any]],
    eval_ids: list[Any],
    found: _Findings,
    progress: Progress | None,
) -> None:
    """Train, check the checkpoint, evaluate the reloaded model, reload it in a fresh process."""
    status = _train_pass(study, run, prep, found, progress)
    _check_checkpoint(run, found)
    predictions, live_logits = _evaluation_pass(study, run, prep, eval_rows, eval_ids, found)
    _fresh_process_checks(study, run, prep, eval_ids, predictions, live_logits, status, found)


def _train_pass(
    study: Study, run: Run, prep: Prepared, found: _Findings, progress: Progress | None
) -> RunStatus:
    """The real run code for the smoke's steps and its checkpoint; the steps, loss and update
    checks (recorded even when training raises); returns the run's status."""
    from tunelab.stages.train import stage as train_stage

    steps_wanted = study.config.training.max_steps
    timings = found.timings
    train_started = time.perf_counter()
    try:
        train_stage.execute_run(study, run, prep, resume=None, progress=progress, strategy=None)
    finally:
        timings["train_s"] = round(time.perf_counter() - train_started, 3)
        steps = _steps(run)
        found.record["losses"] = [r.loss for r in steps]
        found.check(
            "steps ran",
            len(steps) == steps_wanted,
            f"{len(steps)} of {steps_wanted} optimizer steps",
        )
        finite = bool(steps) and all(math.isfinite(r.loss) for r in steps)
        found.check("loss finite", finite, ", ".join(f"{r.loss:.4f}" for r in steps) or "no step")
        if steps:
            later = [r.seconds or 0.0 for r in steps[1:]] or [steps[0].seconds or 0.0]
            timings["first_step_s"] = round(steps[0].seconds or 0.0, 4)
            timings["step_s"] = round(sum(later) / len(later), 4)
            timings["tokens_per_step"] = round(sum(r.tokens or 0 for r in steps) / len(steps), 1)
            timings["peak_memory_bytes"] = max(r.memory_bytes or 0 for r in steps)
    status = RunStatus.of(run.path("status.json"), run.status())
    check = update_check_of(status)
    violations = check.violations
    found.check(
        "update check",
        violations == [] if violations is not None else None,
        _update_detail(check)
        if violations == []
        else ("; ".join(violations[:3]) if violations else "not run"),
    )
    return status


def _steps(run: Run) -> list[TrainStep]:
    """The optimizer steps of the run's metrics.jsonl (its lines with a loss)."""
    path = run.path("metrics.jsonl")
    rows = read_jsonl(path) if path.exists() else []
    return [TrainStep.of(path, r, f"line {i + 1}") for i, r in enumerate(rows) if "loss" in r]


def _update_detail(check: UpdateCheck) -> str:
    detail = "every trainable tensor moved, every frozen one stayed"
    unused = check.unused or []
    if unused:
        detail += (
            f" (but {len(unused)} tensor(s), {check.unused_parameters or 0:,} parameters, got "
            "no gradient: the forward does not use them, not counted as trained): "
            + ", ".join(unused[:3])
        )
    if check.unrouted_experts:
        detail += f"; {len(check.unrouted_experts)} expert tensor(s) no token was routed to"
    return detail


def _check_checkpoint(run: Run, found: _Findings) -> None:
    """The final checkpoint is complete, with the sha256 it recorded; its size and save time."""
    from tunelab.stages.train.checkpoint import final_checkpoint
    from tunelab.stages.verify.stage import check_checkpoint_files

    timings = found.timings
    ckpt = final_checkpoint(run.dir / "checkpoints")
    files = CheckpointCheck.of(
        ckpt or run.dir, check_checkpoint_files(ckpt) if ckpt else {"ok": False, "files_checked": 0}
    )
    timings["checkpoint_save_s"] = _checkpoint_save_s(run, ckpt) if ckpt else None
    size = timings["checkpoint_bytes"] = _bytes(ckpt) if ckpt else None
    found.check(
        "checkpoint written",
        bool(files.ok),
        f"{ckpt.relative_to(run.dir)}: {files.files_checked} files, sha256 as recorded, "
        f"{(size or 0) / 1e6:.1f} MB"
        if ckpt and files.ok
        else "no complete final checkpoint",
    )


def _evaluation_pass(
    study: Study,
    run: Run,
    prep: Prepared,
    eval_rows: list[dict[str, Any]],
    eval_ids: list[Any],
    found: _Findings,
) -> tuple[list[dict[str, Any]], Any]:
    """The model loaded from the checkpoint, evaluated as `tunelab eval` does, its logits on the
    examples and the adapter's cost; returns (predictions, logits)."""
    from tunelab.stages.evaluate.stage import evaluate_model, record_evaluation
    from tunelab.stages.train import load_run_model
    from tunelab.stages.verify.fresh import probe_logits

    timings, labels = found.timings, prep.labels
    model, tokenizer, base = load_run_model(study, run)
    eval_record, predictions = evaluate_model(
        model, tokenizer, base, study, eval_rows, "validation", labels=labels
    )
    eval_record["data_snapshot"] = prep.snapshot.id
    eval_record["base_identity_sha256"] = base.identity.get("sha256")
    record_evaluation(run, eval_record, predictions)
    evaluation = Evaluation.of(run.path("metrics-validation.json"), eval_record)
    n, seconds = evaluation.n, evaluation.seconds or 0.0
    timings["eval_s"] = evaluation.seconds
    timings["eval_s_per_example"] = round(seconds / n, 5) if n else None
    primary = study.config.hypothesis.primary_metric
    value = evaluation.metrics.get(primary)
    found.check(
        "eval ran",
        n == len(eval_ids),
        f"{n} validation examples, {primary} {value:.4f}"
        if isinstance(value, (int, float))
        else f"{n} validation examples",
    )
    live_logits = probe_logits(model, tokenizer, base, study, eval_rows, labels)
    timings["adapter_time_ratio"], timings["adapter_timing"] = adapter_time_ratio(
        model, _adapter_pass(model, tokenizer, base, study, eval_rows, labels)
    )
    return predictions, live_logits


def _fresh_process_checks(
    study: Study,
    run: Run,
    prep: Prepared,
    eval_ids: list[Any],
    predictions: list[dict[str, Any]],
    live_logits: Any,
    status: RunStatus,
    found: _Findings,
) -> None:
    """A new process reloads the checkpoint from disk: the same predictions, logits and
    validation loss as the live model, within the precision's tolerances."""
    import torch

    from tunelab.core.env import device_kind
    from tunelab.stages.train.precision import resolve_precision
    from tunelab.stages.verify.checks import compare_predictions
    from tunelab.stages.verify.fresh import fresh_evaluate
    from tunelab.stages.verify.stage import LOGIT_ATOL, SCORE_ATOL, recorded_copy

    timings, record = found.timings, found.record
    recorded = run.path("metrics-validation.json")
    raw = fresh_evaluate(
        study,
        run.id,
        snapshot=prep.snapshot.id,
        split="validation",
        ids=[p.id for p in _predictions(run, predictions)],
        labels=prep.labels,
        probe_ids=eval_ids,
        val_loss_ids=eval_ids,
        num_threads=torch.get_num_threads(),
        merge=recorded_copy(Evaluation.read(recorded)),
    )
    fresh = FreshOutcome.of(run.path("smoke.json"), raw, "the fresh process")
    timings["reload_s"] = fresh.load_s
    timings["fresh_eval_s"] = fresh.eval_s
    timings["fresh_process_s"] = fresh.process_s
    timings["fresh_checks_s"] = fresh.checks_s
    precision = resolve_precision(study.config.training.precision, device_kind())
    raw_cmp = compare_predictions(predictions, fresh.predictions, atol=SCORE_ATOL[precision])
    record["reload_predictions"] = raw_cmp
    cmp = Reproduced.of(run.path("smoke.json"), raw_cmp, "reload_predictions")
    found.check(
        "fresh-process predictions",
        cmp.ok,
        f"{cmp.matched} of {cmp.n} identical (max score diff {(cmp.max_score_diff or 0):.2g})",
    )
    fresh_logits = raw["probe_logits"]  # a tensor (or None): no JSON field of FreshOutcome
    atol = LOGIT_ATOL[precision]
    diff = (
        float((live_logits - fresh_logits).abs().max())
        if fresh_logits is not None and fresh_logits.shape == live_logits.shape
        else math.inf
    )
    record["reload_logits_max_abs_diff"] = diff
    found.check(
        "fresh-process logits",
        diff <= atol,
        f"max |diff| {diff:.2e} over {tuple(live_logits.shape)} (atol {atol:g})",
    )
    live_val, fresh_val = status.val_loss, fresh.val_loss
    rtol = VAL_LOSS_RTOL[precision]
    if live_val is None or fresh_val is None:
        found.check("fresh-process val loss", None, "no validation loss recorded")
        return
    rel = abs(live_val - fresh_val) / max(1.0, abs(live_val))
    record["reload_val_loss"] = {"live": live_val, "fresh": fresh_val, "rel_diff": rel}
    found.check(
        "fresh-process val loss",
        rel <= rtol,
        f"live model {live_val:.6f}, reloaded {fresh_val:.6f} (rel diff {rel:.1e}, rtol {rtol:g})",
    )


def _timed_evaluation(raw: dict[str, Any]) -> Evaluation:
    """An evaluation `evaluate_model` returned to be timed (not written), read as its kind."""
    return Evaluation.of(Path("the adapter's timed evaluation"), raw)


def _predictions(run: Run, predictions: list[dict[str, Any]]) -> list[Prediction]:
    """The live model's predictions, read as the lines of the predictions it recorded."""
    path = run.path("predictions-validation.jsonl")
    return [Prediction.of(path, p, f"line {i + 1}") for i, p in enumerate(predictions)]
