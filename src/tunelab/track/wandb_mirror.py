"""`sync_wandb(study, ...)`: the study as one W&B project, one W&B run per tunelab run.

The W&B run id is the tunelab run id (the study's own records: `study-<hash of its name>`), so
every sync of a run continues the same W&B run (`resume="allow"`). What this machine sent is
kept in `<wandb dir>/tunelab-sync.json` (per run: the mirror's sha256 and the last step sent): an
unchanged run is not opened again, a changed one gets its new status, config, summary and files
and only the steps after the last one sent. With `WANDB_MODE=offline` each sync of a run writes
an offline run folder that `wandb sync` uploads later, in order, as that one run.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.progress import Progress
from tunelab.core.record_checks import SentState
from tunelab.track.flatten import STUDY_RUN_ID, RunMirror, action_counts, collect_study, run_result
from tunelab.track.optional import TrackingError, import_optional

if TYPE_CHECKING:
    from tunelab.core.study import Study

# W&B marks a run failed for any exit code but 0; 143 = 128 + SIGTERM for an interrupted run
EXIT_CODE = {"completed": 0, "running": 0, "failed": 1, "invalid": 1, "interrupted": 143}
STATE_FILE = "tunelab-sync.json"
_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def wandb_run_id(study_name: str, run_id: str) -> str:
    """The W&B run id of a tunelab run: its own id, which is unique across studies; the study's
    records get one from the study's name."""
    if run_id == STUDY_RUN_ID:
        return "study-" + hashlib.sha256(study_name.encode()).hexdigest()[:12]
    return _ID_CHARS.sub("-", run_id)


def groups(mirrors: list[RunMirror]) -> dict[str, str | None]:
    """The W&B group of each run: a run with a parent is grouped with it, a parent under its
    own id; a run of neither stands alone."""
    parents = {m.tags.get("tunelab.parent") for m in mirrors} - {None}
    return {
        m.run_id: m.tags.get("tunelab.parent") or (m.run_id if m.run_id in parents else None)
        for m in mirrors
    }


def curve_rows(mirror: RunMirror, after: int) -> list[tuple[int, dict[str, float]]]:
    """The step curves as W&B history rows (one per step, ascending), steps after `after`."""
    rows: dict[int, dict[str, float]] = {}
    for p in mirror.points:
        if p.curve and p.step > after:
            rows.setdefault(p.step, {})[p.key] = p.value
    return sorted(rows.items())


def summary(mirror: RunMirror) -> dict[str, Any]:
    """The run's final values: the newest evaluation and smoke values, status and reason."""
    final = {p.key: p.value for p in sorted(mirror.points, key=lambda p: p.step) if not p.curve}
    return {**final, "tunelab.status": mirror.status, "tunelab.reason": mirror.reason or ""}


def config(mirror: RunMirror) -> dict[str, str]:
    return {**mirror.params, **{k: v for k, v in mirror.tags.items() if k.startswith("tunelab.")}}


class SyncState:
    """What this machine sent to W&B, by `project/run id`, in the wandb dir."""

    def __init__(self, folder: Path):
        self.path = folder / STATE_FILE
        self.runs: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.runs, indent=1, sort_keys=True))
        tmp.replace(self.path)


def unchanged(mirror: RunMirror, held: dict[str, Any] | None) -> tuple[str, int, bool]:
    """(the mirror's fingerprint, the last step sent before, whether nothing changed since)."""
    fingerprint = mirror.fingerprint()
    if held is None:
        return fingerprint, -1, False
    state = SentState.of(STATE_FILE, held, mirror.run_id)
    return fingerprint, -1 if state.step is None else state.step, state.sha256 == fingerprint


def sent(
    mirror: RunMirror,
    held: dict[str, Any] | None,
    fingerprint: str,
    last_step: int,
    metrics: int,
) -> dict[str, Any]:
    """What a sync of a changed run reports, and the state it leaves for the next sync."""
    return {
        "action": "updated" if held else "created",
        "params": len(mirror.params),
        "metrics": metrics,
        "state": {"sha256": fingerprint, "step": last_step},
    }


def sync_each(
    mirrors: list[RunMirror],
    state: SyncState,
    progress: Progress | None,
    sync_one: Callable[[RunMirror, dict[str, Any]], tuple[str, dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Sync every mirror in order with `sync_one(mirror, sent_before) -> (state key, result)`
    (`sent_before`: the state of every run, by key), saving
    the state after each run (a killed sync resends at most the run it was on)."""
    results = []
    for i, mirror in enumerate(mirrors):
        if progress is not None:
            progress("track", i, len(mirrors), mirror.run_id)
        key, result = sync_one(mirror, state.runs)
        state.runs[key] = result.pop("state")
        state.save()
        results.append(run_result(mirror, result))
    if progress is not None:
        progress("track", len(mirrors), len(mirrors))
    return results


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """wandb prints to stdout; tunelab's stdout holds only its own result (--json)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _settings(wandb: Any) -> Any:
    return wandb.Settings(
        console="off",
        silent=True,
        save_code=False,
        disable_git=True,
        x_disable_stats=True,
        x_disable_meta=True,
        x_save_requirements=False,
    )


def _copy_files(run: Any, mirror: RunMirror) -> None:
    """The record files into the W&B run's files (a copy as of this sync), uploaded with it."""
    root = Path(run.dir)
    for path, folder in mirror.files:
        target = root / folder / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        run.save(str(target), base_path=str(root), policy="now")


def sync_run(
    wandb: Any,
    opts: dict[str, Any],
    mirror: RunMirror,
    wid: str,
    group: str | None,
    held: dict[str, Any] | None,
) -> dict[str, Any]:
    """Write one tunelab run into its W&B run; returns its result and new state."""
    result = {"wandb_run_id": wid, "action": "unchanged", "params": 0, "metrics": 0, "files": 0}
    fingerprint, after, same = unchanged(mirror, held)
    if same:
        return {**result, "state": held}
    tags = [mirror.kind, mirror.status]
    run = wandb.init(
        id=wid,
        name=mirror.name,
        group=group,
        job_type=mirror.kind,
        tags=tags,
        notes=mirror.tags.get("mlflow.note.content"),
        resume="allow",
        reinit="create_new",
        settings=_settings(wandb),
        **opts,
    )
    try:
        run.config.update(config(mirror), allow_val_change=True)
        rows = curve_rows(mirror, after)
        for step, values in rows:
            run.log(values, step=step)
        run.summary.update(summary(mirror))
        _copy_files(run, mirror)
    finally:
        run.finish(exit_code=EXIT_CODE.get(mirror.status, 1))
    last = rows[-1][0] if rows else after
    metrics = sum(len(v) for _, v in rows)
    return {**result, **sent(mirror, held, fingerprint, last, metrics), "files": len(mirror.files)}


def sync_wandb(
    study: Study,
    *,
    project: str | None = None,
    entity: str | None = None,
    mode: str | None = None,
    directory: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Mirror every run of `study` into the W&B project `project` (default: WANDB_PROJECT, else
    the study's name). `mode` online | offline (default: WANDB_MODE, else online); `directory`
    where wandb writes (default: WANDB_DIR, else the current folder).

    Returns {project, entity, mode, dir, runs: [{run_id, kind, name, status, reason,
    wandb_run_id, action, params, metrics, files}], counts}. Raises TrackingError without the
    `tracking` extra or when W&B refuses (no login online).
    """
    wandb = import_optional("wandb", "mirroring to Weights & Biases")
    name = project or os.environ.get("WANDB_PROJECT") or study.config.name
    mode = mode or os.environ.get("WANDB_MODE") or "online"
    root = Path(directory or os.environ.get("WANDB_DIR") or ".").resolve()
    root.mkdir(parents=True, exist_ok=True)
    state = SyncState(root / "wandb")
    opts = {
        "project": name,
        "entity": entity or os.environ.get("WANDB_ENTITY"),
        "mode": mode,
        "dir": str(root),
    }
    mirrors = collect_study(study)
    family = groups(mirrors)

    def sync_one(mirror: RunMirror, sent_before: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        wid = wandb_run_id(study.config.name, mirror.run_id)
        key = f"{name}/{wid}"
        return key, sync_run(wandb, opts, mirror, wid, family[mirror.run_id], sent_before.get(key))

    with quiet(), _as_tracking_error(name):
        results = sync_each(mirrors, state, progress, sync_one)
    counts = action_counts(results)
    return {
        "project": name,
        "entity": opts["entity"],
        "mode": mode,
        "dir": str(root),
        "runs": results,
        "counts": counts,
    }


@contextlib.contextmanager
def _as_tracking_error(project: str) -> Iterator[None]:
    """wandb's refusals (no API key online, a refused value) as a TrackingError."""
    try:
        yield
    except TrackingError:
        raise
    except Exception as exc:
        errors = import_optional("wandb.errors", "mirroring to Weights & Biases")
        if not isinstance(exc, errors.Error | OSError):
            raise
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackingError(
            f"W&B refused the mirror of project {project}: {text[:500]}",
            hint="run `wandb login`, or set WANDB_MODE=offline and upload later with `wandb sync`",
        ) from exc
