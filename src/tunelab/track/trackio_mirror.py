"""`sync_trackio(study, ...)`: the study as one Trackio project in its local store.

Trackio keeps a run by its name: the name is the W&B run id (the tunelab run id), so a sync
resumes the run it made. What was sent is kept in `<TRACKIO_DIR>/tunelab-sync.json`, as for
W&B: an unchanged run is left alone, a changed one gets only the steps after the last one sent.
Trackio has no run status: `tunelab.status` and `tunelab.reason` are in the run's config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.progress import Progress
from tunelab.track.flatten import RunMirror, action_counts, collect_study
from tunelab.track.optional import TrackingError, import_optional
from tunelab.track.wandb_mirror import (
    EXIT_CODE,
    SyncState,
    config,
    curve_rows,
    groups,
    quiet,
    sent,
    sync_each,
    unchanged,
    wandb_run_id,
)

if TYPE_CHECKING:
    from tunelab.core.study import Study


def open_trackio(directory: Path | None) -> Any:
    """trackio with its store in `directory` (default: TRACKIO_DIR, else Trackio's own); the
    store is fixed when trackio is first imported."""
    if directory is not None:
        os.environ["TRACKIO_DIR"] = str(Path(directory).resolve())
    trackio = import_optional("trackio", "mirroring to Trackio")
    held = Path(trackio.utils.TRACKIO_DIR)
    if directory is not None and held != Path(directory).resolve():
        raise TrackingError(
            f"Trackio's store is already {held} in this process, not {directory}",
            hint="run `tunelab track --trackio DIR` in a process of its own",
        )
    return trackio


def sync_run(
    trackio: Any,
    project: str,
    mirror: RunMirror,
    name: str,
    group: str | None,
    held: dict[str, Any] | None,
) -> dict[str, Any]:
    result = {"trackio_run": name, "action": "unchanged", "params": 0, "metrics": 0, "files": 0}
    fingerprint, after, same = unchanged(mirror, held)
    if same:
        return {**result, "state": held}
    values = {**config(mirror), "tunelab.reason": mirror.reason or ""}
    trackio.init(
        project=project,
        name=name,
        group=group,
        config=values,
        resume="allow",
        embed=False,
        auto_log_gpu=False,
        auto_log_cpu=False,
    )
    try:
        rows = curve_rows(mirror, after)
        for step, row in rows:
            trackio.log(row, step=step)
        finals = [p for p in mirror.points if not p.curve] if held is None else []
        if held is None:  # Trackio lists a run once it has a value: every run has this one
            trackio.log({"tunelab/exit_code": EXIT_CODE.get(mirror.status, 1)}, step=0)
        for p in finals:  # an evaluation's values at its number, as MLflow holds them
            trackio.log({p.key: p.value}, step=p.step)
    finally:
        trackio.finish()
    metrics = sum(len(r) for _, r in rows) + len(finals) + (held is None)
    return {**result, **sent(mirror, held, fingerprint, rows[-1][0] if rows else after, metrics)}


def sync_trackio(
    study: Study,
    *,
    project: str | None = None,
    directory: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Mirror every run of `study` into the Trackio project `project` (default: the study's
    name) of the local store `directory` (default: TRACKIO_DIR, else Trackio's own).

    Returns {project, dir, runs: [{run_id, kind, name, status, reason, trackio_run, action,
    params, metrics, files}], counts}. Raises TrackingError without the `tracking` extra.
    """
    trackio = open_trackio(directory)
    name = project or study.config.name
    store = Path(trackio.utils.TRACKIO_DIR)
    state = SyncState(store)
    mirrors = collect_study(study)
    family = groups(mirrors)

    def sync_one(mirror: RunMirror, sent_before: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        run_name = wandb_run_id(study.config.name, mirror.run_id)
        key = f"{name}/{run_name}"
        return key, sync_run(
            trackio, name, mirror, run_name, family[mirror.run_id], sent_before.get(key)
        )

    with quiet():
        results = sync_each(mirrors, state, progress, sync_one)
    counts = action_counts(results)
    return {"project": name, "dir": str(store), "runs": results, "counts": counts}
