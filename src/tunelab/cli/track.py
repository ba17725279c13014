"""tunelab track: mirror the study's records into MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import JsonOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.cli.progress import ProgressBoard

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


def _ui_command(result: dict[str, Any]) -> str:
    if result["kind"] == "http":
        return f"open {result['uri']}"
    # a folder store found in place: MLflow opens it only with this setting
    env = "MLFLOW_ALLOW_FILE_STORE=true " if result["kind"] == "folder" else ""
    return f"{env}mlflow ui --backend-store-uri {result['uri']}"


def _print(result: dict[str, Any]) -> None:
    rows = [
        [r["run_id"], r["status"], r["action"], r["metrics"], r["files"]] for r in result["runs"]
    ]
    exp = result["experiment"]
    t = table(
        f"MLflow experiment {exp['name']} ({exp['id']})",
        ["run", "status", "mlflow", "values", "files"],
        rows,
    )
    t.columns[0].no_wrap = True
    console.print(t)
    c = result["counts"]
    console.print(
        f"{c['created']} created, {c['updated']} updated, {c['unchanged']} unchanged "
        f"at {result['uri']}"
    )
    console.print(f"see it: `{_ui_command(result)}`", soft_wrap=True)


@app.command()
def track(
    study: StudyDir = Path("."),
    mlflow: MlflowOpt = None,
    experiment: ExperimentOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Mirror every run of the study (params, tags, metric histories, records) into MLflow;
    syncing again updates the runs it made and never duplicates them."""
    from tunelab.track.mlflow_mirror import sync_mlflow

    s = open_study(study, None)
    with ProgressBoard(enabled=not json_out, transient=True) as board:
        result = sync_mlflow(s, mlflow, experiment=experiment, progress=board.update)
    if json_out:
        emit_json(result)
        return
    _print(result)
