"""smoke."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tunelab.cli.common import (
    JsonOpt,
    SetOpt,
    StudyDir,
    app,
    console,
    emit_json,
    fmt,
    open_study,
    rate_unit,
    table,
)
from tunelab.cli.progress import ProgressBoard
from tunelab.core.record_smoke import adapter_timing_of, checks_of
from tunelab.core.record_types import Smoke
from tunelab.core.run_parts import ParameterAudit

_MARK = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]n/a[/]"}


def _bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GB"


def audit_table(audit: ParameterAudit) -> Table:
    """The parameter audit (`tunelab.lib.models.parameter_audit`): one row per module group, a
    total row, and a caption (adapted modules, what a checkpoint holds, bytes by dtype)."""
    t = audit.totals
    out = Table(title=f"Parameters ({audit.method})")
    out.add_column("group")
    out.add_column("trainable", justify="right")
    out.add_column("frozen", justify="right")
    out.add_column("trainable tensors", justify="right")
    for name, g in audit.groups.items():
        out.add_row(name, f"{g.trainable:,}", f"{g.frozen:,}", str(g.tensors_trainable))
    out.add_section()
    out.add_row(
        f"total ({100 * t.trainable_share:.2f}% trainable)",
        f"{t.trainable:,}",
        f"{t.frozen:,}",
        str(t.trainable_tensors),
        style="bold",
    )
    dtypes = "; ".join(
        f"{k}: {_bytes(v.trainable)} trainable, {_bytes(v.frozen)} frozen"
        for k, v in audit.bytes_by_dtype.items()
    )
    lines = [
        f"adapted: {audit.adapted_summary}",
        f"saved in full: {', '.join(audit.modules_to_save) or 'none'}",
        f"checkpoint holds: {audit.saves} ({audit.saved_params:,} parameters)",
        f"bytes: {dtypes}",
    ]
    lines += [f"note: {n}" for n in audit.notes or []]
    out.caption = "\n".join(lines)
    out.caption_justify = "left"
    return out


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
    from tunelab.stages.smoke import stage as smoke_stage
    from tunelab.stages.smoke.stage import SmokeFailed

    s = open_study(study, sets)
    with ProgressBoard(enabled=not json_out) as board:
        run, record = smoke_stage.run(
            s,
            num_train=train_examples,
            num_steps=steps,
            num_eval=eval_examples,
            progress=board.prefixed("smoke"),
        )
    smoke = Smoke.of(run.path("smoke.json"), record)
    if json_out:
        emit_json(record)
    else:
        if run.path("audit.json").exists():
            console.print(audit_table(ParameterAudit.read(run.path("audit.json"))))
        rows = [[c.check, _MARK[c.ok], c.detail] for c in checks_of(smoke)]
        console.print(table(f"smoke {run.id}", ["check", "result", "detail"], rows))
        timing_rows = [
            ["step", f"{fmt(smoke.step_s, 3)} s (first {fmt(smoke.first_step_s, 3)} s)"],
            [f"{rate_unit(s).removesuffix('/s')} per step", fmt(smoke.tokens_per_step, 0)],
            ["eval", f"{fmt(smoke.eval_s_per_example, 4)} s per example"],
            *_adapter_row(smoke),
            ["checkpoint save", f"{fmt(smoke.checkpoint_save_s, 3)} s"],
            [
                "reload (fresh process)",
                f"{fmt(smoke.reload_s, 3)} s to load, {fmt(smoke.fresh_process_s, 1)} s in all",
            ],
            ["total", f"{fmt(smoke.total_s, 1)} s"],
        ]
        console.print(table("timings", ["", ""], timing_rows, show_header=False))
        verdict = "[green]passed[/]" if smoke.passed else "[red]FAILED[/]"
        console.print(f"smoke {verdict}: {smoke.reason}")
        console.print(f"record: {smoke.path}")
    if not smoke.passed:
        raise SmokeFailed(
            f"smoke {run.id} failed: {smoke.reason}",
            hint=(smoke.hint + "; " if smoke.hint else "") + f"the record is {smoke.path}",
        )


def _adapter_row(smoke: Smoke) -> list[list[str]]:
    """'x 1.22 per decoding step (fastest of 3 passes on and off)', when it was timed."""
    how = adapter_timing_of(smoke)
    if not how or not how.raw or smoke.adapter_time_ratio is None:
        return []
    ratio = smoke.adapter_time_ratio
    text = f"x {ratio:.2f} per {how.unit} (fastest of {how.pairs} passes on and off)"
    if ratio < 1.0:  # an unmerged adapter only adds work: faster with it is timing noise
        text += "; under x 1 is timing noise: read it as no measurable cost"
    return [["unmerged adapter", text]]
