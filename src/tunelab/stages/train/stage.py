"""A training run from a study: the record, the statuses, signals, checkpoints and resume.

`run(study)` starts a run with a new id; `tunelab.stages.train.resume.resume_run(study,
run_id)` continues a stopped one in the same folder. Statuses (status.json and the ledger):

- running: with a heartbeat (ledger and status.json) every few seconds
- completed: the final checkpoint is written and `checkpoints/final` points at it
- failed: an exception (out of memory, a torch error); its type, message and traceback kept
- invalid: a non-finite loss, a broken loss mask, or the update check after the first steps
- interrupted: SIGINT / SIGTERM (a checkpoint is saved first), or a SIGKILL found later by a
  stale heartbeat (`Study.reconcile`)

`run(study, *, name, parent, why, progress=None, strategy=None) -> Run` (and `resume_run(study,
run_id, progress=None, strategy=None) -> Run`): `progress("train", step,
total_steps, "loss ... | rate")` on rank 0 after every step (core.progress). Resume keeps the run id
and refuses completed, invalid and running runs, a changed config sha (the recorded `--set`
re-applied), a newer or tampered snapshot and a changed base. Both raise after recording the
status: `InvalidRun` / `PreprocessError` -> invalid (exit 2), `RunFailed` -> failed (exit 1),
`RunInterrupted` -> interrupted (exit 128 + signal; a checkpoint was saved). `prepare_run(study)
-> Prepared` and `execute_run(study, run, prep, resume=None, progress=, strategy=None)` are the
two halves the smoke reuses (keep their names and shapes). `load_run_model(study, run,
checkpoint=None, device=None) -> (model, tokenizer, base)`: the base and the run's final (or
named: step number or "step-000010") checkpoint, in eval mode, on `device` (None:
`compute_device()`; export passes "cpu"), for evaluation, verify and export; refuses a base whose
identity changed.

The run folder: `config.json` (+ `labels`, `base_model` identity), `env.json`, `preprocess.json`
(template sha, length stats), `audit.json`, `compute.json` (device, `precision {requested, used,
why}`, `compile {enabled, blocks}`, `loss_route`, `cross_entropy`, `packing_exact`,
`attention`, `attention_not_used [{route, reason}]`; written once, at the first start),
`metrics.jsonl` (one line per step: step, epoch, loss, lr, grad_norm, tokens, loss_tokens,
seconds, tokens_per_s, memory_bytes, elapsed_s, and val_loss / val_tokens on evaluation steps; a
`step: 0` line with the validation loss before training), `metrics-replayed.jsonl` (steps redone
by a resume), `status.json` (completed: steps, final_loss, val_loss, val_loss_initial, tokens,
train_seconds, tokens_per_s, steps_per_s, final_checkpoint, update_check; failed: error,
traceback), `checkpoints/step-XXXXXX/`, `checkpoints/final -> step-XXXXXX`, and `DONE` when
completed.
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tunelab.core.config import StudyConfig
from tunelab.core.config_training import TrainingConfig
from tunelab.core.errors import (
    CheckpointError,
    ModelError,
    PreprocessError,
    RunError,
    TunelabError,
)
from tunelab.core.progress import Progress
from tunelab.core.records import (
    append_jsonl,
    read_jsonl,
    write_json_atomic,
    write_jsonl_atomic,
)
from tunelab.core.study import Run, Study
from tunelab.stages.hypothesis.stage import require_hypothesis
from tunelab.stages.sizing.gate import require_peaks_fit
from tunelab.stages.smoke.platform import check_platform
from tunelab.stages.train import callbacks as cb
from tunelab.stages.train import checkpoint as ckpt
from tunelab.stages.train import compute, rank_run
from tunelab.stages.train.batches import Position
from tunelab.stages.train.build import build_loop, build_model, seed_everything
from tunelab.stages.train.callbacks import Heartbeat, RunInterrupted, SignalStop
from tunelab.stages.train.loop import InvalidRun, Loop, StepCallback, TrainState, train_loop
from tunelab.stages.train.nodes import copy_fingerprint, from_main, require_same_copies
from tunelab.stages.train.schedule import total_steps
from tunelab.stages.train.strategy import SingleProcess, Strategy
from tunelab.stages.train.validation import validation_batches
from tunelab.track.live import LiveLogger

if TYPE_CHECKING:
    from tunelab.lib.models import BaseModel
    from tunelab.lib.preprocess.text import Preprocessor

RUN_KIND = "train"


class RunFailed(RunError):
    """An exception stopped the run (out of memory, a torch error, ...)."""

    exit_code = 1


# ------------------------------------------------------------------ helpers


def checkpoints_root(run: Run) -> Path:
    """The run's checkpoints folder (on rank 0; a follower's names its own study copy)."""
    return run.dir / "checkpoints"


# ------------------------------------------------------------------ preparing


@dataclass
class Prepared:
    """Everything a run is built from, checked before any weight is touched."""

    cfg: StudyConfig
    hypothesis: dict[str, Any]
    snapshot: Any  # a Snapshot, or the smoke's seeded sample of one (same id and rows())
    base: BaseModel
    labels: list[str] | None
    tokenizer: Any = None
    preprocessor: Preprocessor | None = None
    train: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    train_views: Any = None  # (index, epoch) -> a training example's view that epoch, or None


def prepare_run(study: Study, snapshot_id: str | None = None) -> Prepared:
    """Check a study is ready to train and gather what the run is built from.

    Raises TunelabError if the hypothesis, the data snapshot (`snapshot_id`, or the latest) or
    the base model is missing; loads no tokenizer or weights and encodes nothing, so callers may
    replace `Prepared.snapshot` before `execute_run` tokenizes it.
    """
    from tunelab.lib.models import resolve_base
    from tunelab.lib.tasks import get_task
    from tunelab.stages.data import load_snapshot

    cfg = study.config
    hypothesis = require_hypothesis(study.root, cfg)
    snapshot = load_snapshot(study, snapshot_id)
    base = resolve_base(study)
    task = get_task(cfg, snapshot.labels)
    labels = list(task.labels) if getattr(task, "labels", None) else None
    return Prepared(cfg, hypothesis, snapshot, base, labels)


def _encode(prep: Prepared) -> None:
    """Tokenize both splits; the preprocessing stop conditions raise PreprocessError."""
    from tunelab.lib.models import load_tokenizer
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    prep.tokenizer = load_tokenizer(prep.base)
    task = get_task(prep.cfg, prep.labels)
    pre = Preprocessor(prep.tokenizer, prep.cfg, task, prep.base.architecture)
    prep.preprocessor = pre
    rows = prep.snapshot.rows("train")
    prep.train = [pre.encode_train(r) for r in rows]
    prep.train_views = pre.train_views(rows, prep.train)
    prep.validation = [pre.encode(r) for r in prep.snapshot.rows("validation")]
    if not prep.train:
        raise PreprocessError(
            f"snapshot {prep.snapshot.id} has no training examples",
            hint="check data.splits and the data source, then `tunelab data`",
        )
    pre.check(prep.train)


# ------------------------------------------------------------------ public API


def run(
    study: Study,
    *,
    name: str | None = None,
    parent: str | None = None,
    why: str | None = None,
    progress: Progress | None = None,
    strategy: Strategy | None = None,
    platform_why: str | None = None,
) -> Run:
    """Start a training run; returns the run once it completed.

    `progress("train", step, total_steps, text)` is called on rank 0 after every step (the CLI
    draws the bar). Raises RunInterrupted (SIGINT/SIGTERM, checkpoint saved), InvalidRun / PreprocessError
    (status invalid), RunFailed (status failed) and the usual TunelabErrors before the run
    exists (no hypothesis, no snapshot, no model).
    """
    prep = prepare_run(study)
    require_same_copies(strategy, copy_fingerprint(prep))
    gate = from_main(strategy, lambda: _gate(study, prep, platform_why))
    run = rank_run.create_run(  # rank 0 writes the record; the other ranks follow it
        strategy,
        study,
        RUN_KIND,
        config=prep.cfg,
        name=name,
        parent=parent,
        why=why,
        data_snapshot=prep.snapshot.id,
        hypothesis=prep.hypothesis,
        env=rank_run.environment(strategy),
        extra={
            "labels": prep.labels,
            "base_model": prep.base.identity,
            "hypothesis_evaluation_spec_sha256": prep.hypothesis["evaluation_spec_sha256"],
            "platform_gate": gate,
        },
    )
    execute_run(study, run, prep, resume=None, progress=progress, strategy=strategy)
    return run


def _gate(study: Study, prep: Prepared, platform_why: str | None) -> dict[str, Any]:
    """Rank 0's checks of node 0's records before a run starts: the sizing's peaks, then the
    platform gate (returned)."""
    require_peaks_fit(study, prep.snapshot, "train")
    return check_platform(study, "train", platform_why)


# ------------------------------------------------------------------ the run


def execute_run(
    study: Study,
    run: Run,
    prep: Prepared,
    *,
    resume: Path | None,
    progress: Progress | None,
    strategy: Strategy | None,
) -> None:
    """Train `prep` into `run` and record the outcome as the run's status.

    Every exit path leaves one status (completed, interrupted, invalid or failed); a failure is
    re-raised as a TunelabError (RunInterrupted, RunFailed, ...). `resume` is a checkpoint
    directory to continue from; `strategy=None` trains in this process.
    """
    strategy = strategy or SingleProcess()
    try:
        with SignalStop() as stop, Heartbeat(run, enabled=strategy.is_main) as beat:
            summary = _train(study, run, prep, resume, stop, beat, progress, strategy)
    except RunInterrupted as exc:
        run.set_status("interrupted", exc.message)
        raise
    except KeyboardInterrupt:
        run.set_status("interrupted", "interrupted by a second signal before a checkpoint")
        raise RunInterrupted(
            f"run {run.id} interrupted before a checkpoint was saved",
            hint=f"`tunelab resume {run.id}` continues from its latest checkpoint",
            signum=signal.SIGINT,
        ) from None
    except (InvalidRun, PreprocessError) as exc:
        run.set_status("invalid", exc.message)
        raise
    except TunelabError as exc:
        run.set_status("failed", exc.message, error=type(exc).__name__)
        raise
    except Exception as exc:  # noqa: BLE001 - every exception becomes a recorded status
        text = str(exc).lower()
        oom = isinstance(exc, torch.OutOfMemoryError | MemoryError) or any(
            m in text for m in ("out of memory", "can't allocate memory")
        )
        reason = f"{'out of memory: ' if oom else ''}{type(exc).__name__}: {exc}".strip()
        run.set_status(
            "failed", reason[:2000], error=type(exc).__name__, traceback=traceback.format_exc()
        )
        hint = (
            "lower training.micro_batch_size (raise grad_accum_steps to keep the step), or turn "
            "on training.activation_checkpointing; `tunelab size` measures it"
            if oom
            else f"the traceback is in {run.path('status.json')}"
        )
        raise RunFailed(f"run {run.id} failed: {reason}", hint=hint) from exc
    run.set_status("completed", None, **summary)
    if strategy.is_main:
        (run.dir / "DONE").write_text("")


def _truncate_metrics(run: Run, step: int) -> None:
    """Keep metrics of steps <= `step`; later lines (replayed by the resume) move aside. From
    step 0 (no checkpoint yet) everything is redone, the first validation loss included."""
    path = run.path("metrics.jsonl")
    if not path.exists():
        return
    rows = read_jsonl(path)
    keep = [r for r in rows if r.get("step", 0) <= step] if step > 0 else []
    if len(keep) == len(rows):
        return
    for r in rows[len(keep) :]:
        append_jsonl(run.path("metrics-replayed.jsonl"), {**r, "replayed_after_resume": True})
    write_jsonl_atomic(path, keep, overwrite=True)


def _write_once(path: Path, obj: Any) -> None:
    if not path.exists():
        write_json_atomic(path, obj)


def _preprocess_record(prep: Prepared) -> dict[str, Any]:
    """preprocess.json: the template, the length statistics of both splits, the loss tokens."""
    from tunelab.lib.preprocess.text import length_stats

    return {
        **prep.preprocessor.describe(),
        "train": length_stats(prep.train),
        "validation": length_stats(prep.validation),
        "loss_tokens": sum(
            sum(1 for x in e["labels"][1:] if x != -100) if "labels" in e else 1 for e in prep.train
        ),
    }


def _restore(loop: Loop, resume: Path | None, method: str) -> tuple[TrainState, float]:
    """The state to start from and the training seconds before it: a fresh state, or the
    checkpoint `resume` loaded into the loop's model, optimizer, scheduler and generators."""
    if resume is None:
        return TrainState(), 0.0
    saved = ckpt.load_checkpoint(
        resume,
        model=loop.model,
        optimizer=loop.optimizer,
        scheduler=loop.scheduler,
        scaler=loop.scaler,
        method=method,
        strategy=loop.strategy,
    )
    state = TrainState(
        step=saved.step,
        position=Position.from_dict(saved.position),
        tokens_seen=saved.tokens_seen,
        loss_tokens_seen=saved.loss_tokens_seen,
        last_loss=saved.last_loss,
    )
    return state, saved.elapsed_s or 0.0


def _train(
    study: Study,
    run: Run,
    prep: Prepared,
    resume: Path | None,
    stop: SignalStop,
    beat: Heartbeat,
    progress: Progress | None,
    strategy: Strategy,
) -> dict[str, Any]:
    t = prep.cfg.training
    built = _build(run, prep, strategy)
    loop, steps = built.loop, built.steps
    state, elapsed_before = _restore(loop, resume, prep.cfg.adaptation.method)
    if strategy.is_main:
        # a resume without a checkpoint redoes step 0 (the initial validation loss) too
        _truncate_metrics(run, state.step if state.step > 0 else -1)
    steps_cb = _callbacks(study, run, prep, built, state, elapsed_before, strategy)
    callbacks: list[StepCallback] = [
        cb.StepFigures(built.device, steps_cb.clock),
        steps_cb.update_check,
        steps_cb.validation,
        cb.MetricsLog(run.path("metrics.jsonl"), enabled=strategy.is_main),
        steps_cb.live,
        steps_cb.checkpoints,
        cb.kill_point,
        cb.HeartbeatStep(beat, steps_cb.checkpoints),
        *([cb.ProgressReport(progress, steps, steps_cb.images)] if progress and strategy.is_main
          else []),
        cb.StopOnSignal(stop, steps_cb.saver, run.id),
    ]  # fmt: skip
    beat.step, beat.total_steps = state.step, steps
    try:
        if state.step < steps:
            train_loop(loop, state, callbacks)
        else:
            steps_cb.saver.save(state)  # killed after the last step but before the record
    except BaseException as exc:
        steps_cb.live.close(exc)
        raise
    steps_cb.live.close()
    summary = _finish(run, checkpoints_root(run), state, steps, steps_cb.validation,
                      steps_cb.update_check, steps_cb.clock, strategy, t)  # fmt: skip
    if strategy.is_main and steps_cb.update_check.passed:
        study.ledger.add_event(run.id, "update_check", steps_cb.update_check.record)
    return summary


@dataclass
class _Built:
    """The loop `_train` runs and what its callbacks need of the build."""

    loop: Loop
    device: torch.device
    pad_id: int
    steps: int


def _build(run: Run, prep: Prepared, strategy: Strategy) -> _Built:
    """Encode, build the model and its loop, and record preprocess.json, audit.json and
    compute.json (rank 0). Collectives on every rank."""
    from tunelab.lib.models import compute_device

    cfg, t = prep.cfg, prep.cfg.training
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    _encode(prep)
    if strategy.is_main:
        _write_once(run.path("preprocess.json"), _preprocess_record(prep))
    device = compute_device()
    model, audit = build_model(prep.base, cfg, prep.labels, device, strategy)
    if strategy.is_main:
        _write_once(run.path("audit.json"), audit)
    arch = prep.base.architecture
    pad_id = getattr(prep.tokenizer, "pad_token_id", None) or 0  # an image processor has none
    steps = total_steps(cfg, len(prep.train), strategy.world_size)
    loop = build_loop(model, t, prep.train, architecture=arch, pad_id=pad_id, total_steps=steps,
                      strategy=strategy, views=prep.train_views)  # fmt: skip
    first = prep.train[0]
    probe = torch.tensor([first["input_ids"]]) if "input_ids" in first else None  # images: none
    how = compute.describe_compute(loop.model, t, device, probe, arch)  # every rank: collective
    how.update(compute.describe_load(strategy))  # a collective too
    if strategy.is_main:
        _write_once(run.path("compute.json"), how)
    return _Built(loop, device, pad_id, steps)


@dataclass
class _StepCallbacks:
    """The callbacks `_train` reads again after the loop (or on a signal)."""

    update_check: cb.UpdateCheck
    validation: cb.Validation
    clock: cb.Clock
    saver: cb.CheckpointSaver
    checkpoints: cb.Checkpoints
    live: LiveLogger
    images: bool  # an image study's batches count images


def _callbacks(
    study: Study,
    run: Run,
    prep: Prepared,
    built: _Built,
    state: TrainState,
    elapsed_before: float,
    strategy: Strategy,
) -> _StepCallbacks:
    """The update check, validation (its step-0 loss computed here), clock, checkpoints and
    live logger of a run starting at `state`."""
    cfg, t, loop = prep.cfg, prep.cfg.training, built.loop
    arch, method = prep.base.architecture, cfg.adaptation.method
    val_batches = (
        validation_batches(prep.validation, t, built.pad_id, arch)
        if prep.validation and t.eval_every_steps
        else []
    )
    update_check = cb.UpdateCheck(loop.model, method, t.update_check_steps, state.step)
    validation = cb.Validation(loop, val_batches, t.eval_every_steps)
    validation.before_training(state, run, strategy)
    clock = cb.Clock(elapsed_before)
    identity = {"config_sha256": cfg.sha256(), "data_snapshot": prep.snapshot.id}
    saver = cb.CheckpointSaver(
        checkpoints_root(run), loop, method=method, identity=identity,
        keep_last=t.keep_last_checkpoints, clock=clock, shards_at=_shards_at(cfg, run, strategy),
    )  # fmt: skip
    live = LiveLogger.start(run, t.log_to, enabled=strategy.is_main)  # training.log_to mirrors
    if validation.initial is not None:
        live.log({"step": 0, "val_loss": validation.initial})
    images = study.config.task.kind == "image_classification"
    return _StepCallbacks(update_check, validation, clock, saver,
                          cb.Checkpoints(saver, t.checkpoint_every_steps), live, images)  # fmt: skip


def _shards_at(cfg: StudyConfig, run: Run, strategy: Strategy) -> Any:
    """step -> where a full fine-tune's shards go on several nodes (the shard store; `launch`
    refused the layout without one); None where they go into the checkpoint's folder."""
    from tunelab.stages.train import shard_store
    from tunelab.stages.train.nodes import several_nodes

    if not (several_nodes(strategy) and shard_store.needs_store(cfg, strategy.name, 2)):
        return None
    store = cfg.training.shard_store
    if not store:
        raise RunError(
            f"{shard_store.STORE_FIELD} is not set: a full fine-tune under FSDP on several nodes "
            "writes its shards there",
            hint=f"set {shard_store.STORE_FIELD} in study.yaml (a folder every node mounts, or "
            "s3://bucket/prefix)",
        )
    return lambda step: shard_store.location(store, cfg.name, run.id, step)


def _finish(
    run: Run,
    root: Path,
    state: TrainState,
    steps: int,
    validation: cb.Validation,
    update_check: cb.UpdateCheck,
    clock: cb.Clock,
    strategy: Strategy,
    t: TrainingConfig,
) -> dict[str, Any]:
    """Point `final` at the last checkpoint; the summary that status.json records (rank 0's:
    the other ranks hold no record and return none)."""
    if not strategy.is_main:
        return {}
    final = ckpt.latest_checkpoint(root)
    assert final is not None and final.name == ckpt.step_dir_name(steps)
    ckpt.mark_final(root, steps)
    ckpt.prune_checkpoints(root, t.keep_last_checkpoints)
    rows = [r for r in read_jsonl(run.path("metrics.jsonl")) if "loss" in r]
    elapsed = clock.elapsed()
    return {
        "steps": steps,
        "final_loss": rows[-1]["loss"] if rows else state.last_loss,
        "val_loss": validation.last,
        "val_loss_initial": validation.initial
        if validation.initial is not None
        else _initial_val(run),
        "tokens": state.tokens_seen,
        "loss_tokens": state.loss_tokens_seen,
        "train_seconds": elapsed,
        "tokens_per_s": state.tokens_seen / elapsed if elapsed > 0 else None,
        "steps_per_s": steps / elapsed if elapsed > 0 else None,
        "final_checkpoint": str(final.relative_to(run.dir)),
        "update_check": update_check.record,
    }


def _initial_val(run: Run) -> float | None:
    for r in read_jsonl(run.path("metrics.jsonl")):
        if r.get("step") == 0 and "val_loss" in r:
            return r["val_loss"]
    return None


# ------------------------------------------------------------------ loading a trained model


def load_run_model(
    study: Study,
    run: Run | str,
    checkpoint: str | int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.nn.Module, Any, Any]:
    """The base model with a run's trained weights, in eval mode: (model, tokenizer, base).

    `device`: where the model goes; None for `compute_device()`, where evaluation runs.

    `checkpoint`: None for the final checkpoint, a step number, or a folder name
    ("step-000010"). Raises CheckpointError when the run has no such checkpoint and ModelError
    when the base model no longer matches the one the run trained.
    """
    from tunelab.lib.models import compute_device, load_model, load_tokenizer, resolve_recorded

    run = study.get_run(run) if isinstance(run, str) else run
    record, cfg = run.record, run.config
    root = checkpoints_root(run)
    if checkpoint is None:
        path = ckpt.final_checkpoint(root)
        if path is None:
            found = [p.name for _, p in ckpt.list_checkpoints(root)]
            raise CheckpointError(
                f"run {run.id} has no final checkpoint (status {run.row.status})",
                hint=f"name one of its checkpoints: {', '.join(found)}"
                if found
                else f"resume it with `tunelab resume {run.id}`",
            )
    else:
        name = ckpt.step_dir_name(checkpoint) if isinstance(checkpoint, int) else str(checkpoint)
        path = root / name
        if name == ckpt.FINAL:
            path = ckpt.final_checkpoint(root) or path
        if not (path / "DONE").exists():
            found = [p.name for _, p in ckpt.list_checkpoints(root)]
            raise CheckpointError(
                f"run {run.id} has no complete checkpoint {name!r}",
                hint=f"its checkpoints: {', '.join(found) or 'none'}",
            )
    ckpt.read_checkpoint_state(path)
    recorded = record.base_model or {}
    base = resolve_recorded(cfg.model, study.root, recorded)
    if recorded.get("sha256") and recorded["sha256"] != base.identity["sha256"]:
        raise ModelError(
            f"the base model at {base.path} is not the one run {run.id} trained",
            hint="restore the original model folder (its files' sha256 are in config.json)",
        )
    tokenizer = load_tokenizer(base)
    seed_everything(cfg.training.seed)
    model = load_model(base, cfg, record.labels)
    model = ckpt.load_weights(model, path, cfg.adaptation.method)
    model.to(device if device is not None else compute_device()).eval()
    return model, tokenizer, base


def read_metrics(run: Run) -> list[dict[str, Any]]:
    path = run.path("metrics.jsonl")
    return read_jsonl(path) if path.exists() else []


__all__ = [
    "Prepared",
    "RunFailed",
    "RunInterrupted",
    "execute_run",
    "load_run_model",
    "prepare_run",
    "read_metrics",
    "run",
]
