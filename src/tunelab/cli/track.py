"""tunelab track: mirror the study's records into MLflow and Weights & Biases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import JsonOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.cli.progress import ProgressBoard
from tunelab.core.record_checks import TrackerSync

MlflowOpt = Annotated[
    str | None,
    typer.Option(
        "--mlflow",
        help="Where to mirror: a folder (./mlruns: the SQLite store mlruns/mlflow.db in it), "
        "sqlite:///FILE.db or http://HOST:PORT (default: MLFLOW_TRACKING_URI).",
    ),
]
ExperimentOpt = Annotated[
    str | None,
    typer.Option(
        help="MLflow experiment (default: MLFLOW_EXPERIMENT_NAME, else the study's name)."
    ),
]

WandbOpt = Annotated[
    bool,
    typer.Option(
        "--wandb",
        help="Mirror into Weights & Biases (WANDB_MODE=offline writes run folders for "
        "`wandb sync`).",
    ),
]
WandbProjectOpt = Annotated[
    str | None, typer.Option(help="W&B project (default: WANDB_PROJECT, else the study's name).")
]
WandbEntityOpt = Annotated[str | None, typer.Option(help="W&B entity (default: WANDB_ENTITY).")]
WandbModeOpt = Annotated[
    str | None, typer.Option(help="W&B mode: online or offline (default: WANDB_MODE, else online).")
]

TrackioOpt = Annotated[
    bool,
    typer.Option(
        "--trackio", help="Mirror into Trackio's local store (TRACKIO_DIR, else Trackio's own)."
    ),
]


def _ui_command(result: TrackerSync) -> str:
    if result.kind == "http":
        return f"open {result.uri}"
    # a folder store found in place: MLflow opens it only with this setting
    env = "MLFLOW_ALLOW_FILE_STORE=true " if result.kind == "folder" else ""
    return f"{env}mlflow ui --backend-store-uri {result.uri}"


def _print_sync(title: str, tracker: str, result: TrackerSync, where: str) -> None:
    """A tracker's sync as a table of runs and a line counting what was done."""
    rows = [[r.run_id, r.status, r.action, r.metrics, r.files] for r in result.runs]
    t = table(title, ["run", "status", tracker, "values", "files"], rows)
    t.columns[0].no_wrap = True
    console.print(t)
    c = result.counts
    console.print(f"{c.created} created, {c.updated} updated, {c.unchanged} unchanged {where}")


def _print(result: TrackerSync) -> None:
    title = f"MLflow experiment {result.experiment_name} ({result.experiment_id})"
    _print_sync(title, "mlflow", result, f"at {result.uri}")
    console.print(f"see it: `{_ui_command(result)}`", soft_wrap=True)


def _print_wandb(result: TrackerSync) -> None:
    title = f"W&B project {result.project} ({result.mode})"
    _print_sync(title, "wandb", result, f"in {result.dir}/wandb")
    if result.mode == "offline":
        console.print(f"upload it: `wandb sync {result.dir}/wandb`", soft_wrap=True)


def _print_trackio(result: TrackerSync) -> None:
    c = result.counts
    console.print(
        f"Trackio project {result.project}: {c.created} created, {c.updated} updated, "
        f"{c.unchanged} unchanged in {result.dir}"
    )
    console.print(f"see it: `TRACKIO_DIR={result.dir} trackio show`", soft_wrap=True)


@app.command()
def track(
    study: StudyDir = Path("."),
    mlflow: MlflowOpt = None,
    experiment: ExperimentOpt = None,
    wandb: WandbOpt = False,
    wandb_project: WandbProjectOpt = None,
    wandb_entity: WandbEntityOpt = None,
    wandb_mode: WandbModeOpt = None,
    trackio: TrackioOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Mirror every run of the study (params, tags, metric histories, records) into MLflow
    and, with --wandb, Weights & Biases; syncing again updates the runs it made and never
    duplicates them."""
    import os

    from tunelab.track.mlflow_mirror import sync_mlflow
    from tunelab.track.wandb_mirror import sync_wandb

    s = open_study(study, None)
    results: dict[str, Any] = {}
    with ProgressBoard(enabled=not json_out, transient=True) as board:
        if wandb:
            results["wandb"] = sync_wandb(
                s,
                project=wandb_project,
                entity=wandb_entity,
                mode=wandb_mode,
                progress=board.update,
            )
        if trackio:
            from tunelab.track.trackio_mirror import sync_trackio

            results["trackio"] = sync_trackio(s, progress=board.update)
        if not (wandb or trackio) or mlflow or os.environ.get("MLFLOW_TRACKING_URI"):
            results["mlflow"] = sync_mlflow(s, mlflow, experiment=experiment, progress=board.update)
    if json_out:
        emit_json(results["mlflow"] if list(results) == ["mlflow"] else results)
        return
    # each summary read as a TrackerSync, named by the tracker it came from
    synced = {name: TrackerSync.of(name, raw) for name, raw in results.items()}
    printers = {"wandb": _print_wandb, "trackio": _print_trackio, "mlflow": _print}
    for name, summary in synced.items():
        printers[name](summary)
