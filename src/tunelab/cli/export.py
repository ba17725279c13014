"""export, check-export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

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
from tunelab.core.record_export import ProcessorGap
from tunelab.core.record_export_check import ExportCheck
from tunelab.core.record_types import ExportManifest


@app.command()
def export(
    run_id: Annotated[str, typer.Argument(help="The completed training run.")],
    study: StudyDir = Path("."),
    out: Annotated[
        Path | None, typer.Option(help="Destination folder (default records/exports/<id>).")
    ] = None,
    notes: Annotated[
        list[str] | None,
        typer.Option("--notes", help="A limitation or remark for the model card (repeatable)."),
    ] = None,
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="LoRA/QLoRA: merge the adapter into the (dequantized) base, checked against "
            "the adapted model.",
        ),
    ] = False,
    merge_dtype: Annotated[
        str, typer.Option(help="dtype of the merged model: bf16 or fp32.")
    ] = "bf16",
    merge_atol: Annotated[
        float | None,
        typer.Option(help="Largest logit difference the merged model may show (default 0.25)."),
    ] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Export the adapter (peft) or the full model (safetensors), tokenizer, manifest, model card."""
    from tunelab.stages.export import stage as export_stage
    from tunelab.stages.export.manifest import MANIFEST
    from tunelab.stages.export.merge import MergeTolerance

    s = open_study(study, sets)
    tolerance = MergeTolerance() if merge_atol is None else MergeTolerance(merge_atol)
    path, manifest = export_stage.run(
        s,
        run_id,
        out=out,
        notes=notes or [],
        merge_dtype=merge_dtype if merge else None,
        merge_tolerance=tolerance,
    )
    if json_out:
        emit_json({"path": str(path), "manifest": manifest})
        return
    m = ExportManifest.of(path / MANIFEST, manifest)
    rows = _summary_rows(path, m)
    console.print(table("export", ["", ""], rows, show_header=False))
    for line in m.limitations or []:
        console.print(f"  limitation: {line}", highlight=False)
    base_arg = m.bound_base.argument
    console.print(f"next: `tunelab check-export {path} --base {base_arg}`", soft_wrap=True)


def _processor_text(p: ProcessorGap) -> str:
    """The exported image processor against the study's transforms, in a cell."""
    if p.matches:
        return f"gives the training transforms' pixel values (max diff {p.max_abs_diff:.1e})"
    why = p.error or f"max diff {p.max_abs_diff:.2e}"
    return f"[yellow]not the training transforms[/] ({escape(why)}): see the card"


def _as_json(value: Any) -> str:
    """A gold value as it is written in the data: JSON (null, false), a string as it is."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _base_text(result: ExportCheck) -> str:
    """Which base was checked: what --base named, against the manifest's base and commit."""
    base, hub = result.base, result.base.hub
    recorded = result.base_name + (f" at {hub.commit[:12]}" if hub else "")
    given = base.given or base.folder
    text = f"{base.files_checked} files of {recorded} match --base {given}"
    repo = given.partition("@")[0]
    if hub and "/" in repo and repo != hub.repo_id and not Path(given).exists():
        text += " (the same files under another repo id)"
    return text


@app.command("check-export")
def check_export_cmd(
    directory: Annotated[Path, typer.Argument(help="The export folder.")],
    base: Annotated[
        str,
        typer.Option(
            "--base",
            help="The base model folder, or a hub id org/repo[@revision] (from the hub cache).",
        ),
    ],
    json_out: JsonOpt = False,
) -> None:
    """Verify an export against its manifest and the base by sha256, then run one example.

    Exit code 2 when the export or the base does not match; 1 when the example's output differs
    from the recorded one.
    """
    from tunelab.stages.export import ExampleMismatch, check_export

    result = check_export(directory, base)
    checked = ExportCheck.of(directory, result)
    ex = checked.example
    if json_out:
        emit_json(result)
    else:
        rows = [
            ["export", checked.export],
            ["files", f"{checked.files.files_checked} match the manifest (and its sha256)"],
            ["base", _base_text(checked)],
            ["loaded", f"{checked.artifact.kind} in {fmt(checked.load_s, 2)} s"],
        ]
        if ex:
            rows += [
                ["example", f"{ex.id} (gold {_as_json(ex.gold)})"],
                ["output", repr(ex.raw_output)],
                [
                    "recorded",
                    ("same" if ex.matches_recorded else f"[red]differs: {ex.recorded!r}[/]")
                    + f" (max score diff {fmt(ex.scores_max_diff, 6)})",
                ],
            ]
        if checked.processor is not None and checked.processor.raw:
            rows.append(["processor", _processor_text(checked.processor)])
        console.print(table("check-export", ["", ""], rows, show_header=False))
    if ex and not ex.matches_recorded:
        raise ExampleMismatch(
            f"the exported model gave {ex.output!r} on example {ex.id}, recorded {ex.recorded!r}",
            hint="on another platform small differences are possible; on the same one the "
            "export does not reproduce its run",
        )


def _summary_rows(path: Path, m: ExportManifest) -> list[list[str]]:
    """The summary table: the export, its base, its results and the merge check."""
    entry, base = m.comparison, m.bound_base
    primary = entry.primary if entry is not None else None
    guardrails = m.guardrail_check
    passed = guardrails.passed if guardrails is not None else None
    rows = [
        ["export", str(path)],
        ["run", m.run_id],
        ["artifact", m.contents.text if m.contents else "-"],
        ["base", f"{base.name} sha256 {str(base.sha256)[:16]}..."],
        [
            "primary metric",
            f"{primary.metric} {fmt(primary.baseline)} -> "
            f"{fmt(primary.variant)} ({fmt(primary.delta)})"
            if primary is not None and primary.raw
            else "not compared",
        ],
        ["guardrails", "-" if passed is None else ("pass" if passed else "[red]FAIL[/]")],
        ["files", f"{len(m.files or {})} with sha256 in tunelab-manifest.json"],
    ]
    if (merged := m.merge_check) is not None:
        rows.append(
            [
                "merge check",
                f"{merged.examples} examples: logits max diff "
                f"{fmt(merged.logits_max_abs_diff, 4)} (<= {merged.logits_bound}), greedy "
                f"{merged.greedy_agreement:.1%}, predictions {merged.prediction_agreement:.1%}",
            ]
        )
    return rows
