"""smoke."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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

_MARK = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]n/a[/]"}


@app.command()
def smoke(
    study: StudyDir = Path("."),
    train_examples: Annotated[int, typer.Option(help="Training examples (a seeded sample).")] = 8,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 2,
    eval_examples: Annotated[int, typer.Option(help="Validation examples evaluated.")] = 4,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """A few examples through training, evaluation and a checkpoint reloaded in a new process.

    Exit code 1 when a check fails (the record says which).
    """
    from tunelab.smoke import SmokeFailed, run_smoke

    s = open_study(study, sets)
    run, record = run_smoke(
        s,
        num_train=train_examples,
        num_steps=steps,
        num_eval=eval_examples,
        progress=not json_out,
    )
    if json_out:
        emit_json(record)
    else:
        rows = [[c["check"], _MARK[c["ok"]], c["detail"]] for c in record["checks"]]
        console.print(table(f"smoke {run.id}", ["check", "result", "detail"], rows))
        timing_rows = [
            [
                "step",
                f"{fmt(record.get('step_s'), 3)} s (first {fmt(record.get('first_step_s'), 3)} s)",
            ],
            ["tokens per step", fmt(record.get("tokens_per_step"), 0)],
            ["eval", f"{fmt(record.get('eval_s_per_example'), 4)} s per example"],
            *_adapter_row(record),
            ["checkpoint save", f"{fmt(record.get('checkpoint_save_s'), 3)} s"],
            [
                "reload (fresh process)",
                f"{fmt(record.get('reload_s'), 3)} s to load, "
                f"{fmt(record.get('fresh_process_s'), 1)} s in all",
            ],
            ["total", f"{fmt(record.get('total_s'), 1)} s"],
        ]
        console.print(table("timings", ["", ""], timing_rows, show_header=False))
        verdict = "[green]passed[/]" if record["passed"] else "[red]FAILED[/]"
        console.print(f"smoke {verdict}: {record['reason']}")
        console.print(f"record: {record['path']}")
    if not record["passed"]:
        raise SmokeFailed(
            f"smoke {run.id} failed: {record['reason']}",
            hint=(record.get("hint") + "; " if record.get("hint") else "")
            + f"the record is {record['path']}",
        )


def _adapter_row(record: dict) -> list[list[str]]:
    """'x 1.22 per decoding step (fastest of 3 passes on and off)', when it was timed."""
    how = record.get("adapter_timing")
    if not how or record.get("adapter_time_ratio") is None:
        return []
    return [
        [
            "unmerged adapter",
            f"x {record['adapter_time_ratio']:.2f} per {how['unit']} "
            f"(fastest of {how['pairs']} passes on and off)",
        ]
    ]
