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
from tunelab.core.record_parts import CheckpointCheck
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
    v = Verify.read(record["path"])
    if json_out:
        emit_json(record)
    else:
        ck, pred = v.checkpoint_check, v.reproduced
        timings, env = v.fresh_timings, v.environment_check
        rows = [
            ["run", f"{v.run_id} (model of {v.model_run}, {v.model_kind})"],
            ["recorded predictions", f"{v.evaluation_run} ({v.split})"],
            ["checkpoint files", _checkpoint_text(ck)],
            [
                "predictions",
                "not run"
                if pred is None or not pred.raw
                else f"{pred.matched} of {pred.n} reproduced, max score diff "
                f"{fmt(pred.max_score_diff, 6)} (atol {pred.atol:g})",
            ],
            [
                "environment",
                "same as the run's" if env and env.same else "[yellow]differs[/]",
            ],
            [
                "fresh process",
                f"load {fmt(timings.load_s, 2)} s, eval {fmt(timings.eval_s, 2)} s"
                if timings and timings.raw
                else "-",
            ],
        ]
        console.print(table("verify", ["", ""], rows, show_header=False))
        for m in pred.mismatches if pred else []:
            console.print(
                f"  [red]mismatch[/] {m.id} {m.what}: recorded {m.recorded!r}, fresh {m.fresh!r}",
                highlight=False,
            )
        if env and env.message:
            console.print(f"[yellow]{env.message}[/]", highlight=False)
        verdict = "[green]passed[/]" if v.passed else "[red]FAILED[/]"
        console.print(f"verify {verdict}: {v.reason}", highlight=False)
        console.print(f"record: {v.path}", soft_wrap=True, highlight=False)  # whole
    if not v.passed:
        raise VerifyFailed(
            f"run {v.model_run} not verified: {v.reason}", hint=f"the record is {v.path}"
        )


def _checkpoint_text(ck: CheckpointCheck | None) -> str:
    if ck is None:
        return "-"
    if ck.ok:
        return f"{ck.files_checked} match their sha256"
    return "[red]changed: " + ", ".join((ck.changed or []) + (ck.missing or [])) + "[/]"
