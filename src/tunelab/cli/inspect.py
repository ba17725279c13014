"""inspect: examples after the exact preprocessing of training; stops on a broken mask or an
image the chain cannot convert."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.rule import Rule
from rich.text import Text

from tunelab.cli.common import (
    JsonOpt,
    SetOpt,
    StudyDir,
    app,
    console,
    emit_json,
    open_study,
    table,
)
from tunelab.cli.progress import ProgressBoard
from tunelab.core.errors import DataError
from tunelab.core.record_inspect import InspectExample, Inspection, LengthStats
from tunelab.lib.preprocess.text import Problem, raise_problems

SPLITS = ("train", "validation")


def loss_place(ex: InspectExample) -> str:
    """Where the loss is: on tokens for a generating model, on the label for a classifier."""
    if ex.classifier:
        return "the loss is on the label (a classifier: no token carries it)"
    return f"{ex.num_loss_tokens} under the loss"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def token_text(ex: InspectExample) -> Text:
    """The example's tokens: loss positions on green, special tokens magenta, cut point red."""
    out = Text()
    for i, t in enumerate(ex.tokens):
        if ex.truncation_at == i:
            out.append(" \u2702 ", style="bold white on red")
        piece = t.text.replace("\n", "\u21b5\n")
        style = "bold magenta" if t.special else ""
        if t.loss:
            style = (style + " on dark_green").strip()
        out.append(piece, style=style or None)
    return out


def _print_example(ex: InspectExample) -> None:
    cut = f", input cut {ex.input_tokens_cut}/{ex.input_tokens} tokens" if ex.truncated else ""
    console.print(Rule(Text(f"{ex.id}  {ex.category}"), align="left"))
    console.print(
        Text(
            f"shown for: {ex.why_shown}; {ex.num_tokens} tokens, {loss_place(ex)}{cut}",
            style="dim",
        )
    )
    console.print(token_text(ex))
    if ex.loss_decoded is not None:
        mark = "[green]\u2713[/]" if ex.check == "ok" else f"[red]\u2717 {escape(str(ex.check))}[/]"
        console.print(Text("loss decodes to: ") + Text(repr(ex.loss_decoded), style="green"))
        console.print(f"target check: {mark}")
    elif ex.classifier:
        console.print(Text(f"label: {ex.target_text} (index {ex.label_index})"))


def _lengths_table(record: Inspection) -> Any:
    def row(name: str, st: LengthStats) -> list[Any]:
        return [name, st.n, st.p50, st.p95, st.max, _pct(st.share_truncated)]

    stats = record.stats or LengthStats(record.path, {}, where="stats")
    rows = [row("all", stats)]
    per_category = record.category_stats if len(record.category_stats) > 1 else {}
    rows += [row(name, c) for name, c in per_category.items()]
    return table("lengths (tokens)", ["category", "n", "p50", "p95", "max", "truncated"], rows)


def print_record(record: Inspection) -> None:
    pre = record.preprocess
    console.print(
        f"[bold]{escape(str(record.study))}[/] split {record.split}, "
        f"snapshot {record.snapshot_id}, "
        f"task {record.task_kind}, {pre.architecture}, template {pre.template} "
        f"(sha256 {str(record.template_sha256)[:12]}), max_seq_len {pre.max_seq_len}, "
        f"cut side {pre.truncation_side}"
    )
    console.print(
        Text.assemble(
            "legend: ",
            ("loss", "on dark_green"),
            "  ",
            ("<special>", "bold magenta"),
            "  \u21b5 newline  ",
            (" \u2702 ", "bold white on red"),
            " truncation point",
        )
    )
    for ex in record.examples:
        _print_example(ex)
    console.print(_lengths_table(record))
    if record.answer_budget and (warning := record.answer_budget.warning):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    for note in pre.notes or []:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if (why := record.collator_skipped) is not None:
        console.print(f"[yellow]note:[/] collator check skipped: {escape(why)}")
    console.print(Text(f"record: {record.path}\npage:   {record.html_path}"))
    if record.ok:
        console.print(f"[green]all checks pass[/] on {record.n} examples")


@app.command("inspect")
def inspect_cmd(
    study: StudyDir = Path("."),
    per_category: Annotated[
        int, typer.Option("--per-category", min=1, help="Examples shown per category.")
    ] = 2,
    split: Annotated[str, typer.Option(help="train | validation (test is sealed).")] = "train",
    snapshot: Annotated[
        str | None, typer.Option(help="Data snapshot id (default: the latest).")
    ] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show examples after the exact preprocessing of training, and stop on what the model
    would misread: a broken mask (text), an image that does not convert faithfully (images)."""
    from tunelab.stages.inspect import stage as inspect_stage

    if split not in SPLITS:
        raise DataError(
            f"--split {split!r}: inspect reads train or validation",
            hint="the test split is sealed; it opens only with `tunelab eval RUN --split test --final`",
        )
    s = open_study(study, sets)
    with ProgressBoard(enabled=not json_out, transient=True) as board:
        record = inspect_stage.run(
            s, split=split, per_category=per_category, snapshot_id=snapshot, progress=board.update
        )
    inspection = Inspection.of(Path(record["json_path"]), record)
    if json_out:
        emit_json(record)
    elif inspection.images:
        from tunelab.cli.inspect_images import print_image_record

        print_image_record(inspection)
    else:
        print_record(inspection)
    raise_problems([Problem(**p) for p in inspection.problems or []], what="inspect checks")
