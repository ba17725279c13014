"""train, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import (
    JsonOpt,
    SetOpt,
    StudyDir,
    app,
    console,
    emit_json,
    fmt,
    open_study,
    table,
)
from tunelab.study import Run


def _summary(run: Run) -> dict[str, Any]:
    status = run.status()
    return {
        "run_id": run.id,
        "status": status["status"],
        "record": str(run.dir),
        **{k: v for k, v in status.items() if k not in ("run_id", "status", "reason", "at")},
    }


def _print(summary: dict[str, Any], title: str) -> None:
    rows = [
        ["run", summary["run_id"]],
        ["status", summary["status"]],
        ["steps", summary.get("steps")],
        ["final loss", fmt(summary.get("final_loss"))],
        ["val loss", f"{fmt(summary.get('val_loss_initial'))} -> {fmt(summary.get('val_loss'))}"],
        ["time", f"{fmt(summary.get('train_seconds'), 1)} s"],
        ["tokens/s", fmt(summary.get("tokens_per_s"), 0)],
        ["checkpoint", summary.get("final_checkpoint")],
        ["record", summary["record"]],
    ]
    console.print(table(title, ["", ""], rows, show_header=False))
    console.print(f"next: `tunelab eval {summary['run_id']}`")


@app.command()
def train(
    study: StudyDir = Path("."),
    name: Annotated[str | None, typer.Option(help="A short name for the run.")] = None,
    parent: Annotated[
        str | None, typer.Option(help="The run this variant changes one thing of.")
    ] = None,
    why: Annotated[str | None, typer.Option(help="What this run changes and why.")] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a run with a new id: progress bar, metrics.jsonl, atomic checkpoints."""
    from tunelab.train import train_run

    s = open_study(study, sets)
    run = train_run(s, name=name, parent=parent, why=why, progress=not json_out)
    summary = _summary(run)
    if json_out:
        emit_json(summary)
        return
    _print(summary, "training run")


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="The stopped run (id, prefix or name).")],
    study: StudyDir = Path("."),
    json_out: JsonOpt = False,
) -> None:
    """Continue an interrupted run from its latest checkpoint, to the same result."""
    from tunelab.train import resume_run

    s = open_study(study, None)
    run = resume_run(s, run_id, progress=not json_out)
    summary = _summary(run)
    if json_out:
        emit_json(summary)
        return
    _print(summary, "resumed run")
