"""verify."""

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
from tunelab.core.record_types import Verify


@app.command()
def verify(
    run_id: Annotated[str, typer.Argument(help="The run (train, eval, smoke or baseline).")],
    study: StudyDir = Path("."),
    atol: Annotated[
        float | None,
        typer.Option(help="Tolerance on recorded scores (default by precision: fp32 2e-4)."),
    ] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Reload the run's checkpoint in a fresh process; it must reproduce the recorded predictions.

    Exit code 1 when it does not (the record verify-<n>.json says why).
    """
    from tunelab.stages.verify import stage as verify_stage
    from tunelab.stages.verify.stage import VerifyFailed

    s = open_study(study, sets)
    record = verify_stage.run(s, run_id, atol=atol)
    v = Verify.of(record["path"], record)
    if json_out:
        emit_json(record)
    else:
        ck = v.checkpoint
        pred = v.predictions or {}
        timings = v.timings or {}
        env = v.environment or {}
        rows = [
            ["run", f"{v.run_id} (model of {v.model_run}, {v.model_kind})"],
            ["recorded predictions", f"{v.evaluation_run} ({v.split})"],
            [
                "checkpoint files",
                "-"
                if ck is None
                else (
                    f"{ck['files_checked']} match their sha256"
                    if ck["ok"]
                    else "[red]changed: " + ", ".join(ck["changed"] + ck["missing"]) + "[/]"
                ),
            ],
            [
                "predictions",
                "not run"
                if not pred
                else f"{pred['matched']} of {pred['n']} reproduced, max score diff "
                f"{fmt(pred.get('max_score_diff'), 6)} (atol {pred['atol']:g})",
            ],
            ["environment", "same as the run's" if env.get("same") else "[yellow]differs[/]"],
            [
                "fresh process",
                f"load {fmt(timings.get('load_s'), 2)} s, eval {fmt(timings.get('eval_s'), 2)} s"
                if timings
                else "-",
            ],
        ]
        console.print(table("verify", ["", ""], rows, show_header=False))
        for m in pred.get("mismatches") or []:
            console.print(
                f"  [red]mismatch[/] {m['id']} {m['field']}: recorded {m['recorded']!r}, "
                f"fresh {m['fresh']!r}",
                highlight=False,
            )
        if env.get("message"):
            console.print(f"[yellow]{env['message']}[/]", highlight=False)
        verdict = "[green]passed[/]" if v.passed else "[red]FAILED[/]"
        console.print(f"verify {verdict}: {v.reason}", highlight=False)
        console.print(f"record: {v.path}", soft_wrap=True, highlight=False)  # whole
    if not v.passed:
        raise VerifyFailed(
            f"run {v.model_run} not verified: {v.reason}", hint=f"the record is {v.path}"
        )
