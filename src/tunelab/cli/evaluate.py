"""baseline, eval."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tunelab.cli.common import (
    JsonOpt,
    SetOpt,
    StudyDir,
    app,
    console,
    console_err,
    emit_json,
    fmt,
    open_study,
    table,
)
from tunelab.cli.progress import ProgressBoard
from tunelab.core.env import BUSY_CPU_SHARE
from tunelab.core.record_parts import Confusion, FieldMetrics
from tunelab.core.record_types import Evaluation
from tunelab.lib.inference.eval_copy import describe_copy, ran_on_copy
from tunelab.lib.metrics import OVERALL_METRICS, failure_kind


def print_evaluation(ev: Evaluation, title: str) -> None:
    """The overall metrics, the per-category or per-field table and the confusion matrix."""
    m = ev.metrics
    rows = [[k, fmt(m[k])] for k in OVERALL_METRICS.get(ev.task_kind, ()) if m.get(k) is not None]
    rows += [
        ["examples", ev.n],
        ["examples/s", fmt(ev.examples_per_s, 2)],
        ["spec sha256", (ev.spec_sha256 or "")[:12]],
    ]
    if ev.cpu_share is not None:
        rows.insert(-1, ["CPU share of its threads", fmt(ev.cpu_share, 2)])
    gen = ev.decoding
    if gen is not None and gen.raw:
        rows.insert(
            -1,
            [
                "decoding steps",  # a batch steps until its last row ends: not a token count
                f"{gen.steps} in {len(gen.batches or [])} batches (the gold answers would "
                f"take {gen.answer_steps})",
            ],
        )
        rows.insert(-1, ["ms a decoding step", fmt(1000 * (gen.s_per_step or 0), 1)])
    merge = ev.merge or {}
    if ran_on_copy(merge) or "check_s" in merge:  # a copy was made: used, or why not
        rows.insert(-1, ["evaluated on", describe_copy(merge)])
    if ev.torch_threads:
        rows.insert(-1, ["threads", ev.torch_threads])
    console.print(table(title, ["metric", "value"], rows))
    if ev.per_category:
        cats = [
            [c, fmt(v.precision), fmt(v.recall), fmt(v.f1), v.support]
            for c, v in ev.per_category.items()
        ]
        console.print(table("per category", ["category", "precision", "recall", "F1", "n"], cats))
        if ev.confusion is not None:
            for part in confusion_tables(ev.confusion, console.width):
                console.print(part)
    if ev.per_field:
        # short heads leave the path room at 80 columns (`quantities[].unit`)
        heads = ["pres", "exact", "match", "P", "R", "F1", "slots"]
        fields = [
            [f, *(fmt(x, 3) for x in _field_rates(v)), "" if v.slots is None else v.slots]
            for f, v in ev.per_field.items()
        ]
        console.print(table("per field", ["field", *heads], fields))
    if ev.failure_counts:
        console.print(
            table("failures", ["kind", "count"], [[k, v] for k, v in ev.failure_counts.items()])
        )
    over = gen.answers_over_budget if gen is not None else None
    if over:
        console_err.print(
            f"[yellow]warning:[/] {over} of {ev.n} gold answers are longer than "
            f"evaluation.max_new_tokens ({(ev.evaluation or {}).get('max_new_tokens')}): generation "
            "stops before their end and they cannot be judged right (`tunelab inspect` names "
            "the longest)"
        )
    share = ev.cpu_share
    if share is not None and share < BUSY_CPU_SHARE:
        console_err.print(
            f"[yellow]note:[/] this evaluation had {100 * share:.0f} % of its threads' CPU time: "
            "another process shared the cores, so its timing is high (`tunelab plan` prices "
            "evaluations from the baseline's)"
        )


def _field_rates(v: FieldMetrics) -> list[float | None]:
    return [v.presence_rate, v.exact_match, v.normalized_match, v.precision, v.recall, v.f1]


def confusion_tables(conf: Confusion, width: int) -> list[Table]:
    """The confusion matrix in tables that fit `width` columns: full label names as headers when
    they fit; otherwise each column is numbered as its row ("3 nouvelles-sport"), and a matrix
    too wide still is paged into several tables of consecutive columns."""
    labels, columns, matrix = conf.labels or [], conf.predicted or [], conf.matrix or []
    digits = max((len(str(v)) for row in matrix for v in row), default=1)
    names = [str(label) for label in labels]
    label_w = min(max(len("gold"), *map(len, names)), 32)
    full = label_w + 4 + sum(max(len(str(c)), digits) + 3 for c in columns)
    title = "confusion (rows: gold, columns: predicted)"
    if full <= width:
        heads, rows = [str(c) for c in columns], names
    else:
        heads = [str(j + 1) for j in range(len(labels))] + ["none"] * (len(columns) - len(labels))
        rows = [f"{i + 1} {name}" for i, name in enumerate(names)]
        label_w = min(max(map(len, rows)), 36)
        title += ", numbered as the rows"
    cell_w = max(digits, *map(len, heads))
    per_page = max(1, (width - label_w - 4) // (cell_w + 3))
    tables = []
    for start in range(0, len(columns), per_page):
        end = min(start + per_page, len(columns))
        paged = f" ({start + 1}-{end} of {len(columns)})" if per_page < len(columns) else ""
        t = Table(title=title + paged, title_justify="left")
        t.add_column("gold", overflow="fold", max_width=label_w)
        for head in heads[start:end]:
            t.add_column(head, justify="right", no_wrap=True)
        for name, row in zip(rows, matrix, strict=True):
            t.add_row(name, *(str(v) for v in row[start:end]))
        tables.append(t)
    return tables


def failure_examples(predictions: list[dict[str, Any]]) -> list[str]:
    """One line per failure kind: the first example that failed so, and why (its parse error),
    so a reader sees where answers leave the format without opening the predictions file."""
    seen: dict[str, str] = {}
    for p in predictions:
        kind = failure_kind(p.get("verdicts") or {})
        if kind and kind not in seen:
            seen[kind] = f"  {kind}, e.g. {p.get('id')}: {p.get('parse_error') or '-'}"
    return list(seen.values())


def _print_failure_examples(run_dir: Path, split: str) -> None:
    from tunelab.core.records import read_jsonl

    path = run_dir / f"predictions-{split}.jsonl"
    lines = failure_examples(read_jsonl(path)) if path.exists() else []
    if lines:
        console.print(
            "\n".join(["failures by kind, first example of each:", *lines]), highlight=False
        )


def _warn_test_openings(ev: Evaluation) -> None:
    if ev.warning:
        console_err.print(f"[bold red on white] WARNING [/] [bold red]{ev.warning}[/]")


@app.command()
def baseline(study: StudyDir = Path("."), sets: SetOpt = None, json_out: JsonOpt = False) -> None:
    """Evaluate the untouched base model on the validation split (a run of kind baseline)."""
    from tunelab.stages.evaluate import stage as evaluate_stage

    s = open_study(study, sets)
    with ProgressBoard(enabled=not json_out) as board:
        run, record = evaluate_stage.run(s, progress=board.update)
    if json_out:
        emit_json({"record": str(run.dir), **record})
        return
    ev = Evaluation.of(run.path(f"metrics-{record['split']}.json"), record)
    print_evaluation(ev, f"baseline on {ev.split}")
    _print_failure_examples(run.dir, ev.split)
    console.print(f"run {run.id}, record: {run.dir}")
    from tunelab.cli.hypothesis import print_power
    from tunelab.stages.hypothesis.power import registration_power

    print_power(registration_power(s, s.config))  # now from the baseline's own predictions
    console.print("next: `tunelab smoke`, `tunelab size`, then `tunelab train`")


@app.command("eval")
def eval_(
    run_id: Annotated[str, typer.Argument(help="The run to evaluate (id, prefix or name).")],
    study: StudyDir = Path("."),
    split: Annotated[
        str, typer.Option(help="validation, or test (sealed: needs --final).")
    ] = "validation",
    final: Annotated[
        bool, typer.Option("--final", help="Open the sealed test split (logged).")
    ] = False,
    why: Annotated[str | None, typer.Option(help="Why the test split is opened.")] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Evaluate a run with the baseline's procedure (a run of kind eval, parent RUN)."""
    from tunelab.stages.evaluate import stage as evaluate_stage

    s = open_study(study, sets)
    with ProgressBoard(enabled=not json_out) as board:
        run, record = evaluate_stage.run(
            s, run_id, split=split, final=final, why=why, progress=board.update
        )
    ev = Evaluation.of(run.path(f"metrics-{record['split']}.json"), record)
    _warn_test_openings(ev)
    if json_out:
        emit_json({"record": str(run.dir), **record})
        return
    print_evaluation(ev, f"{ev.split} evaluation")
    _print_failure_examples(run.dir, ev.split)
    console.print(f"evaluated run {ev.evaluates}")
    if ev.test_openings:
        console.print(f"test split openings in this study: {ev.test_openings}")
    console.print(f"run {run.id}, record: {run.dir}")
    console.print("next: `tunelab compare`")
