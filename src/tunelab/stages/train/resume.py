"""Resuming a stopped training run in its own folder, from its latest complete checkpoint.

Rank 0 decides from node 0's records (the run, its status, its recorded config and snapshot,
its latest checkpoint, the platform gate) and tells the other ranks; they read only their own
node's study copy (study.yaml with the run's overrides, the snapshot, the base model), which
must be node 0's (`tunelab.stages.train.nodes.require_same_copies`). A single process is rank 0.

`resume_run(study, run_id, *, progress=None, strategy=None, platform_why=None) -> Run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.core.errors import CheckpointError, RunError
from tunelab.core.ledger import utc_now
from tunelab.core.progress import Progress
from tunelab.core.records import append_jsonl
from tunelab.core.study import Run, Study
from tunelab.stages.hypothesis.stage import diff_dicts
from tunelab.stages.sizing.gate import require_peaks_fit
from tunelab.stages.smoke.platform import check_platform
from tunelab.stages.train import checkpoint as ckpt
from tunelab.stages.train import rank_run
from tunelab.stages.train.layout import incomplete_checkpoints
from tunelab.stages.train.nodes import copy_fingerprint, from_main, require_same_copies
from tunelab.stages.train.resume_check import require_resume_state
from tunelab.stages.train.stage import (
    RUN_KIND,
    Prepared,
    checkpoints_root,
    execute_run,
    prepare_run,
)
from tunelab.stages.train.strategy import SingleProcess, Strategy


@dataclass
class Resumable:
    """What rank 0 found in node 0's records, for every rank."""

    run_id: str
    overrides: list[str]
    data_snapshot: str


@dataclass
class Start:
    """Where the resumed run starts: its latest complete checkpoint's name (None: the start),
    the incomplete ones skipped, and the platform gate."""

    checkpoint: str | None
    skipped: list[str]
    gate: dict[str, Any]


def resume_run(
    study: Study,
    run_id: str,
    *,
    progress: Progress | None = None,
    strategy: Strategy | None = None,
    platform_why: str | None = None,
) -> Run:
    """Continue a stopped run in its own folder from its latest complete checkpoint.

    Refuses a completed, invalid or still-running run, a changed config (study.yaml plus the
    run's recorded --set overrides), a changed data snapshot, or a changed base model.
    """
    strategy = strategy or SingleProcess()
    found = from_main(strategy, lambda: resumable(study, run_id))
    resumed = Study.open(study.root, found.overrides)
    # a node other than 0 joined with its copy's precision; the run's own comes from node 0
    strategy.use_precision(resumed.config.training.precision)
    prep = prepare_run(resumed, found.data_snapshot)
    require_same_copies(strategy, copy_fingerprint(prep))
    start = from_main(strategy, lambda: starting_point(resumed, found.run_id, prep, platform_why))
    held = (
        study.get_run(found.run_id) if strategy.is_main else rank_run.follower(study, found.run_id)
    )
    run = rank_run.follow(strategy, held)
    run.set_status(
        "running",
        f"resumed from {start.checkpoint or 'the start (no checkpoint yet)'}"
        + "".join(f"; {name} skipped: no DONE marker (cut by a kill)" for name in start.skipped),
    )
    if strategy.is_main:
        _record_resume(study, run, start)
    latest = checkpoints_root(run) / start.checkpoint if start.checkpoint else None
    execute_run(resumed, run, prep, resume=latest, progress=progress, strategy=strategy)
    return run


def resumable(study: Study, run_id: str) -> Resumable:
    """The run `run_id` of node 0's records, if it may be resumed with the study as it is."""
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
    record = run.record
    resumed = Study.open(study.root, record.overrides or [])
    cfg = resumed.config
    if cfg.sha256() != record.config_sha256:
        changes = diff_dicts(record.config, cfg.to_dict())
        shown = "; ".join(f"{d['path']}: {d['old']!r} -> {d['new']!r}" for d in changes[:8])
        raise RunError(
            f"run {run.id} was started with another config: {shown}",
            hint="undo the edit of study.yaml to resume, or start a new run with `tunelab train` "
            f"(e.g. --parent {run.id})",
        )
    from tunelab.stages.data import load_snapshot

    latest = load_snapshot(resumed)
    if latest.id != record.data_snapshot:
        raise RunError(
            f"the data snapshot changed since run {run.id} started "
            f"({(record.data_snapshot or '')[:12]} -> {latest.id[:12]})",
            hint="a resumed run must see the same data; start a new run with `tunelab train`",
        )
    return Resumable(run.id, list(record.overrides or []), str(record.data_snapshot))


def starting_point(study: Study, run_id: str, prep: Prepared, platform_why: str | None) -> Start:
    """Rank 0's checks of the base, the latest checkpoint, the peaks and the platform."""
    run = study.get_run(run_id)
    record = run.record
    if prep.base.identity["sha256"] != (record.base_model or {}).get("sha256"):
        raise RunError(
            f"the base model changed since run {run.id} started ({prep.base.path})",
            hint="restore the original model folder, or start a new run",
        )
    root = checkpoints_root(run)
    ckpt.remove_stale_temp(root)
    latest = ckpt.latest_checkpoint(root)
    if latest is not None:
        state = ckpt.read_checkpoint_state(latest)
        require_resume_state(latest, state.raw)
        if (state.config_sha256, state.data_snapshot) != (
            record.config_sha256,
            record.data_snapshot,
        ):
            raise CheckpointError(
                f"{latest} was written for another config or snapshot",
                hint="the run folder was edited; start a new run",
            )
    require_peaks_fit(study, prep.snapshot, "resume")
    gate = check_platform(study, "resume", platform_why)
    skipped = [p.name for p in incomplete_checkpoints(root, latest)]
    return Start(latest.name if latest else None, skipped, gate)


def _record_resume(study: Study, run: Run, start: Start) -> None:
    """Rank 0: the skipped checkpoints, the platform the run resumed on, an override."""
    if start.skipped:
        study.ledger.add_event(run.id, "checkpoint_skipped", start.skipped)
    append_jsonl(run.path("platforms.jsonl"), {"at": utc_now(), "command": "resume", **start.gate})
    if "override" in start.gate:
        study.ledger.add_event(run.id, "platform_override", start.gate["override"])
