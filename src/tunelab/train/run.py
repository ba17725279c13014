"""A training run from a study: the record, the statuses, signals, checkpoints and resume.

`train_run(study)` starts a run with a new id; `resume_run(study, run_id)` continues a stopped
one in the same folder. Statuses (status.json and the ledger):

- running: with a heartbeat (ledger and status.json) every few seconds
- completed: the final checkpoint is written and `checkpoints/final` points at it
- failed: an exception (out of memory, a torch error); its type, message and traceback kept
- invalid: a non-finite loss, a broken loss mask, or the update check after the first steps
- interrupted: SIGINT / SIGTERM (a checkpoint is saved first), or a SIGKILL found later by a
  stale heartbeat (`Study.reconcile`)
"""

from __future__ import annotations

import math
import os
import random
import resource
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunelab.config import StudyConfig, validate_config
from tunelab.errors import (
    CheckpointError,
    ModelError,
    PreprocessError,
    RunError,
    TunelabError,
)
from tunelab.hypothesis import diff_dicts, require_hypothesis
from tunelab.ledger import utc_now
from tunelab.records import (
    append_jsonl,
    read_json,
    read_jsonl,
    write_json_atomic,
    write_jsonl_atomic,
)
from tunelab.study import Run, Study
from tunelab.track.live import LiveLogger
from tunelab.train import checkpoint as ckpt
from tunelab.train import compute, distributed
from tunelab.train.batches import DataOrder, Position, StepSource, eval_batches
from tunelab.train.loop import (
    InvalidRun,
    Loop,
    TrainState,
    build_optimizer,
    build_scheduler,
    make_grad_scaler,
    train_loop,
    validation_loss,
)
from tunelab.train.strategy import SingleProcess, Strategy

HEARTBEAT_EVERY_S = 5.0
RUN_KIND = "train"


class RunInterrupted(RunError):
    """SIGINT or SIGTERM: a checkpoint was saved and the process stops (exit 128 + signal)."""

    def __init__(self, message: str, hint: str | None = None, signum: int = signal.SIGTERM):
        super().__init__(message, hint)
        self.exit_code = 128 + int(signum)


class RunFailed(RunError):
    """An exception stopped the run (out of memory, a torch error, ...)."""

    exit_code = 1


# ------------------------------------------------------------------ helpers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def total_steps(cfg: StudyConfig, num_train: int, world_size: int = 1) -> int:
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    per_step = t.micro_batch_size * t.grad_accum_steps * world_size
    return max(1, math.ceil(t.num_epochs * num_train / per_step))


def _ckpt_root(run: Run) -> Path:
    return run.dir / "checkpoints"


class SignalStop:
    """Turns the first SIGINT/SIGTERM into a flag the loop checks after each step; a second
    one interrupts at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> SignalStop:
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: signals stay with the caller
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------ preparing


@dataclass
class Prepared:
    """Everything a run is built from, checked before any weight is touched."""

    cfg: StudyConfig
    hypothesis: dict[str, Any]
    snapshot: Any
    base: Any
    labels: list[str] | None
    tokenizer: Any = None
    preprocessor: Any = None
    train: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)


def prepare_run(study: Study, snapshot_id: str | None = None) -> Prepared:
    """Check a study is ready to train and gather what the run is built from.

    Raises TunelabError if the hypothesis, the data snapshot (`snapshot_id`, or the latest) or
    the base model is missing; loads no tokenizer or weights and encodes nothing, so callers may
    replace `Prepared.snapshot` before `execute_run` tokenizes it.
    """
    from tunelab.data import load_snapshot
    from tunelab.models import resolve_base
    from tunelab.tasks import get_task

    cfg = study.config
    hypothesis = require_hypothesis(study.root, cfg)
    snapshot = load_snapshot(study, snapshot_id)
    base = resolve_base(study)
    task = get_task(cfg, snapshot.labels)
    labels = list(task.labels) if getattr(task, "labels", None) else None
    return Prepared(cfg, hypothesis, snapshot, base, labels)


def _encode(prep: Prepared) -> None:
    """Tokenize both splits; the preprocessing stop conditions raise PreprocessError."""
    from tunelab.models import load_tokenizer
    from tunelab.preprocess import Preprocessor
    from tunelab.tasks import get_task

    prep.tokenizer = load_tokenizer(prep.base)
    task = get_task(prep.cfg, prep.labels)
    pre = Preprocessor(prep.tokenizer, prep.cfg, task, prep.base.architecture)
    prep.preprocessor = pre
    prep.train = [pre.encode(r) for r in prep.snapshot.rows("train")]
    prep.validation = [pre.encode(r) for r in prep.snapshot.rows("validation")]
    if not prep.train:
        raise PreprocessError(
            f"snapshot {prep.snapshot.id} has no training examples",
            hint="check data.splits and the data source, then `tunelab data`",
        )
    pre.check(prep.train)


def _build_model(prep: Prepared, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    from tunelab.models import adapt, enable_activation_checkpointing, load_model

    cfg = prep.cfg
    seed_everything(cfg.training.seed)  # head and LoRA initialization
    model = load_model(prep.base, cfg, prep.labels)
    model, audit = adapt(model, cfg.adaptation, prep.base.architecture)
    if cfg.training.activation_checkpointing:
        enable_activation_checkpointing(model)
    return model.to(device), audit


# ------------------------------------------------------------------ public API


def train_run(
    study: Study,
    *,
    name: str | None = None,
    parent: str | None = None,
    why: str | None = None,
    resume_from: str | None = None,
    progress: bool = False,
    strategy: Strategy | None = None,
) -> Run:
    """Start a training run (or continue `resume_from`); returns the run once it completed.

    Raises RunInterrupted (SIGINT/SIGTERM, checkpoint saved), InvalidRun / PreprocessError
    (status invalid), RunFailed (status failed) and the usual TunelabErrors before the run
    exists (no hypothesis, no snapshot, no model).
    """
    if resume_from is not None:
        return resume_run(study, resume_from, progress=progress, strategy=strategy)
    prep = prepare_run(study)
    run = distributed.create_run(  # rank 0 writes the record; the other ranks follow it
        strategy,
        study,
        RUN_KIND,
        config=prep.cfg,
        name=name,
        parent=parent,
        why=why,
        data_snapshot=prep.snapshot.id,
        hypothesis=prep.hypothesis,
        env=distributed.environment(strategy),
        extra={
            "labels": prep.labels,
            "base_model": prep.base.identity,
            "hypothesis_evaluation_spec_sha256": prep.hypothesis["evaluation_spec_sha256"],
        },
    )
    execute_run(study, run, prep, resume=None, progress=progress, strategy=strategy)
    return run


def resume_run(
    study: Study, run_id: str, *, progress: bool = False, strategy: Strategy | None = None
) -> Run:
    """Continue a stopped run in its own folder from its latest complete checkpoint.

    Refuses a completed, invalid or still-running run, a changed config (study.yaml plus the
    run's recorded --set overrides), a changed data snapshot, or a changed base model.
    """
    study.reconcile()
    run = study.get_run(run_id)
    row = run.row
    if row.kind != RUN_KIND:
        raise RunError(f"run {run.id} is a {row.kind} run, not a training run")
    if row.status in ("completed", "invalid", "running"):
        why = {
            "completed": "it already completed",
            "invalid": f"it is invalid ({row.reason})",
            "running": f"it is still running (pid {row.pid})",
        }[row.status]
        raise RunError(
            f"run {run.id} cannot be resumed: {why}",
            hint="start a new run with `tunelab train` (a run is never restarted over itself)",
        )
    record = read_json(run.path("config.json"))
    resumed = Study.open(study.root, record.get("overrides") or [])
    cfg = resumed.config
    if cfg.sha256() != record["config_sha256"]:
        changes = diff_dicts(record["config"], cfg.to_dict())
        shown = "; ".join(f"{d['path']}: {d['old']!r} -> {d['new']!r}" for d in changes[:8])
        raise RunError(
            f"run {run.id} was started with another config: {shown}",
            hint="undo the edit of study.yaml to resume, or start a new run with `tunelab train` "
            f"(e.g. --parent {run.id})",
        )
    from tunelab.data import load_snapshot

    latest = load_snapshot(resumed)
    if latest.id != record["data_snapshot"]:
        raise RunError(
            f"the data snapshot changed since run {run.id} started "
            f"({record['data_snapshot'][:12]} -> {latest.id[:12]})",
            hint="a resumed run must see the same data; start a new run with `tunelab train`",
        )
    prep = prepare_run(resumed, record["data_snapshot"])
    if prep.base.identity["sha256"] != record["base_model"]["sha256"]:
        raise RunError(
            f"the base model changed since run {run.id} started ({prep.base.path})",
            hint="restore the original model folder, or start a new run",
        )
    root = _ckpt_root(run)
    ckpt.remove_stale_temp(root)
    latest_ckpt = ckpt.latest_checkpoint(root)
    if latest_ckpt is not None:
        state = ckpt.read_checkpoint_state(latest_ckpt)
        if (state["config_sha256"], state["data_snapshot"]) != (
            record["config_sha256"],
            record["data_snapshot"],
        ):
            raise CheckpointError(
                f"{latest_ckpt} was written for another config or snapshot",
                hint="the run folder was edited; start a new run",
            )
    run = distributed.follow(strategy, run)
    run.set_status(
        "running",
        f"resumed from {latest_ckpt.name if latest_ckpt else 'the start (no checkpoint yet)'}",
    )
    execute_run(resumed, run, prep, resume=latest_ckpt, progress=progress, strategy=strategy)
    return run


# ------------------------------------------------------------------ the run


def execute_run(
    study: Study,
    run: Run,
    prep: Prepared,
    *,
    resume: Path | None,
    progress: bool,
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


def _train(
    study: Study,
    run: Run,
    prep: Prepared,
    resume: Path | None,
    stop: SignalStop,
    beat: Heartbeat,
    progress: bool,
    strategy: Strategy,
) -> dict[str, Any]:
    from tunelab.models import capture_params, check_update
    from tunelab.preprocess import length_stats

    cfg, t = prep.cfg, prep.cfg.training
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    _encode(prep)
    pre = prep.preprocessor
    if strategy.is_main:
        _write_once(
            run.path("preprocess.json"),
            {
                **pre.describe(),
                "train": length_stats(prep.train),
                "validation": length_stats(prep.validation),
                "loss_tokens": sum(
                    sum(1 for x in e["labels"][1:] if x != -100) if "labels" in e else 1
                    for e in prep.train
                ),
            },
        )
    from tunelab.models import compute_device

    device = compute_device()
    model, audit = _build_model(prep, device)
    if strategy.is_main:
        _write_once(run.path("audit.json"), audit)
    compiled = compute.prepare_model(model, t, device)
    method = cfg.adaptation.method
    arch = prep.base.architecture
    packing = t.packing and arch == "causal_lm"
    pad_id = prep.tokenizer.pad_token_id if prep.tokenizer.pad_token_id is not None else 0
    model = strategy.wrap_model(model)
    probe = torch.tensor([prep.train[0]["input_ids"]])
    how = compute.describe_compute(model, t, device, probe, arch, compiled)
    if strategy.is_main:
        _write_once(run.path("compute.json"), how)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, t)
    steps = total_steps(cfg, len(prep.train), strategy.world_size)
    scheduler = build_scheduler(optimizer, t, steps)
    scaler = make_grad_scaler(t.precision, device)
    source = StepSource(
        prep.train,
        DataOrder(len(prep.train), t.seed),
        t.micro_batch_size,
        t.grad_accum_steps,
        pad_id,
        arch,
        packing,
        strategy.world_size,
        strategy.shard_indices,
    )
    loop = Loop(model, optimizer, scheduler, source, t, steps, arch, strategy, scaler)
    val_batches = (
        eval_batches(prep.validation, t.micro_batch_size, pad_id, arch, packing)
        if prep.validation and t.eval_every_steps
        else []
    )
    root = _ckpt_root(run)
    identity = {"config_sha256": cfg.sha256(), "data_snapshot": prep.snapshot.id}

    state = TrainState()
    elapsed_before = 0.0
    if resume is not None:
        saved = distributed.load_checkpoint(
            strategy,
            resume,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            method=method,
        )
        state = TrainState(
            step=saved["step"],
            position=Position.from_dict(saved["position"]),
            tokens_seen=saved["tokens_seen"],
            loss_tokens_seen=saved["loss_tokens_seen"],
            last_loss=saved["last_loss"],
        )
        elapsed_before = saved.get("elapsed_s", 0.0)
    if strategy.is_main:
        # a resume without a checkpoint redoes step 0 (the initial validation loss) too
        _truncate_metrics(run, state.step if state.step > 0 else -1)

    before = capture_params(model) if state.step < t.update_check_steps else None
    update_check: dict[str, Any] = {"after_step": t.update_check_steps, "violations": None}
    if before is None:
        update_check["note"] = "resumed after the check step; checked in the first attempt"
    val = {"initial": None, "last": None}
    if val_batches and state.step == 0:
        # every rank evaluates the whole split (an FSDP forward is collective): no reduction
        loss, n = validation_loss(model, val_batches, arch, t.precision)
        val["initial"] = loss
        if strategy.is_main:
            append_jsonl(run.path("metrics.jsonl"), {"step": 0, "val_loss": loss, "val_tokens": n})

    started = time.perf_counter()
    bar = _Progress(steps, state.step) if progress and strategy.is_main else None

    def save(s: TrainState) -> Path:
        path = distributed.save_checkpoint(
            strategy,
            root,
            s.step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            method=method,
            state={
                **identity,
                "position": s.position.to_dict(),
                "epoch": source.order.epoch_float(s.position),
                "tokens_seen": s.tokens_seen,
                "loss_tokens_seen": s.loss_tokens_seen,
                "last_loss": s.last_loss,
                "total_steps": steps,
                "elapsed_s": elapsed_before + time.perf_counter() - started,
            },
        )
        if strategy.is_main:
            ckpt.prune_checkpoints(root, t.keep_last_checkpoints)
        return path

    def on_step(s: TrainState, row: dict[str, Any]) -> None:
        row["memory_bytes"] = peak_memory_bytes(device)
        row["elapsed_s"] = elapsed_before + time.perf_counter() - started
        if before is not None and s.step == t.update_check_steps:
            violations = check_update(before, model, s.step, method)
            update_check["violations"] = violations
            if violations:
                raise InvalidRun(
                    f"update check after step {s.step}: {len(violations)} tensor(s) wrong: "
                    + "; ".join(violations[:5]),
                    hint="check adaptation (targets, frozen modules) and training.lr",
                )
        if val_batches and (s.step % t.eval_every_steps == 0 or s.step == steps):
            row["val_loss"], row["val_tokens"] = validation_loss(
                model, val_batches, arch, t.precision
            )
            val["last"] = row["val_loss"]
        if strategy.is_main:
            append_jsonl(run.path("metrics.jsonl"), row)
            live.log(row)
        saved_now = False
        if s.step == steps or (t.checkpoint_every_steps and s.step % t.checkpoint_every_steps == 0):
            save(s)
            saved_now = True
        ckpt.kill_for_test("step", s.step)
        beat.step = s.step
        if saved_now:
            beat.beat()
        if bar is not None:
            bar.update(s.step, row)
        signum = distributed.agreed_stop(strategy, stop.signum)
        if signum is not None and s.step < steps:
            path = save(s)
            name = signal.Signals(signum).name
            raise RunInterrupted(
                f"run {run.id} stopped by {name} after step {s.step}; checkpoint {path.name} saved",
                hint=f"`tunelab resume {run.id}` continues it to the same result",
                signum=signum,
            )

    beat.step, beat.total_steps = state.step, steps
    live = LiveLogger.start(run, t.log_to, enabled=strategy.is_main)  # training.log_to mirrors
    if val["initial"] is not None:
        live.log({"step": 0, "val_loss": val["initial"]})
    try:
        if state.step < steps:
            train_loop(loop, state, on_step)
        else:
            save(state)  # killed after the last step but before the record was finished
    except BaseException as exc:
        live.close(exc)
        raise
    finally:
        if bar is not None:
            bar.close()
    live.close()
    final = ckpt.latest_checkpoint(root)
    assert final is not None and final.name == ckpt.step_dir_name(steps)
    if strategy.is_main:
        ckpt.mark_final(root, steps)
        ckpt.prune_checkpoints(root, t.keep_last_checkpoints)
    rows = [r for r in read_jsonl(run.path("metrics.jsonl")) if "loss" in r]
    elapsed = elapsed_before + time.perf_counter() - started
    if strategy.is_main and update_check["violations"] in ([], None):
        study.ledger.add_event(run.id, "update_check", update_check)
    return {
        "steps": steps,
        "final_loss": rows[-1]["loss"] if rows else state.last_loss,
        "val_loss": val["last"],
        "val_loss_initial": val["initial"] if val["initial"] is not None else _initial_val(run),
        "tokens": state.tokens_seen,
        "loss_tokens": state.loss_tokens_seen,
        "train_seconds": elapsed,
        "tokens_per_s": state.tokens_seen / elapsed if elapsed > 0 else None,
        "steps_per_s": steps / elapsed if elapsed > 0 else None,
        "final_checkpoint": str(final.relative_to(run.dir)),
        "update_check": update_check,
    }


def _initial_val(run: Run) -> float | None:
    for r in read_jsonl(run.path("metrics.jsonl")):
        if r.get("step") == 0 and "val_loss" in r:
            return r["val_loss"]
    return None


class Heartbeat:
    """Says the run is alive every HEARTBEAT_EVERY_S from a background thread (ledger and
    status.json, with the current step), so a slow step, a long evaluation or a big checkpoint
    never looks like a dead process to `Study.reconcile`. Stopped before the final status."""

    def __init__(self, run: Run, enabled: bool = True):
        self.run = run
        self.enabled = enabled
        self.step = 0
        self.total_steps: int | None = None
        self.reason = run.row.reason if enabled else None  # e.g. "resumed from step-000003"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tunelab-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self.beat()
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a missed beat (busy disk, locked ledger) is retried
                pass

    def beat(self) -> None:
        with self._lock:
            if self._stop.is_set() or not self.enabled:
                return
            now = utc_now()
            self.run.heartbeat()
            write_json_atomic(
                self.run.path("status.json"),
                {
                    "run_id": self.run.id,
                    "status": "running",
                    "reason": self.reason,
                    "at": now,
                    "heartbeat_at": now,
                    "pid": os.getpid(),
                    "step": self.step,
                    "total_steps": self.total_steps,
                },
                overwrite=True,
            )


class _Progress:
    """A rich progress bar on stderr: step, loss, tokens/s, ETA."""

    def __init__(self, total: int, done: int):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=done, loss="-", tps="-")

    def update(self, step: int, row: dict[str, Any]) -> None:
        tps = row.get("tokens_per_s")
        self.progress.update(
            self.task,
            completed=step,
            loss=f"{row['loss']:.4f}",
            tps=f"{tps:,.0f}" if tps else "-",
        )

    def close(self) -> None:
        self.progress.stop()


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
    from tunelab.models import compute_device, load_model, load_tokenizer, resolve_recorded

    run = study.get_run(run) if isinstance(run, str) else run
    record = read_json(run.path("config.json"))
    cfg = validate_config(record["config"], source=str(run.path("config.json")))
    root = _ckpt_root(run)
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
    recorded = record.get("base_model") or {}
    base = resolve_recorded(cfg.model, study.root, recorded)
    if recorded.get("sha256") and recorded["sha256"] != base.identity["sha256"]:
        raise ModelError(
            f"the base model at {base.path} is not the one run {run.id} trained",
            hint="restore the original model folder (its files' sha256 are in config.json)",
        )
    tokenizer = load_tokenizer(base)
    seed_everything(cfg.training.seed)
    model = load_model(base, cfg, record.get("labels"))
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
    "resume_run",
    "train_run",
]
