"""compare."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tunelab.cli.common import (
    JsonOpt,
    StudyDir,
    app,
    console,
    console_err,
    emit_json,
    fmt,
    open_study,
    table,
)
from tunelab.core.record_parts import CompareEntry, ConfigDiff, Delta, GuardrailVerdict
from tunelab.core.record_types import Compare


def _delta(entry: Delta | None) -> str:
    if entry is None or entry.delta is None:
        return "-"
    text = f"{entry.delta:+.4f}"
    if entry.ci_low is not None:
        text += f" [{entry.ci_low:+.4f}, {entry.ci_high:+.4f}]"
    return text


def _ids(count: int | None, what: str, ids: list[Any] | None, shown: int = 8) -> str:
    """`69 improved: a, b, ... (61 more)`: the first ids of a flip list, comma-separated."""
    if not count:
        return f"0 {what}"
    more = f" ({count - shown} more)" if count > shown else ""
    return f"{count} {what}: " + ", ".join(map(str, (ids or [])[:shown])) + more


def _print_run(run: CompareEntry) -> None:
    name = f"{run.name}  " if run.name else ""
    console.print(f"\n[bold]{name}{run.run_id}[/]")
    rows = [[m, fmt(v.baseline), fmt(v.variant), _delta(v)] for m, v in run.metrics.items()]
    console.print(table("vs baseline", ["metric", "baseline", "run", "delta [95% CI]"], rows))
    if (mc := run.mcnemar) is not None:
        console.print(
            f"McNemar ({mc.method}): {mc.c} examples improved, {mc.b} regressed, "
            f"p = {mc.p_value:.4g}"
        )
    for items, what in ((run.per_category, "category"), (run.per_field, "field")):
        if items:
            console.print(_per_item_table(f"per {what} delta [95% CI]", what, items))
    console.print(_guardrail_table(run.guardrails))
    fl = run.flips
    console.print(
        f"flips: {_ids(fl.num_improved, 'improved', fl.improved)}; "
        f"{_ids(fl.num_regressed, 'regressed', fl.regressed)}"
    )
    _print_diff(run.config_diff)
    if run.why:
        console.print(f"why: {run.why}")
    for flag in run.flags or []:
        console.print(f"[bold yellow]flag:[/] {flag}")
    for note in run.notes or []:
        console.print(f"note: {note}")


def _print_diff(diff: ConfigDiff | None) -> None:
    if diff is None:
        return
    shown = lambda v: "null" if v is None else v  # noqa: E731
    changes = [[c.group, c.key, shown(c.old), shown(c.new)] for c in diff.changes]
    if changes:
        console.print(f"config diff against {diff.against}:")
        console.print(table(None, ["group", "path", "was", "now"], changes))
    else:
        console.print(f"config diff against {diff.against}: no difference")


_VERDICT = {
    "pass": "[green]pass[/]",
    "fail": "[red]FAIL[/]",
    "inconclusive": "[yellow]inconclusive[/]",
}


def _guardrail_table(guards: list[GuardrailVerdict]) -> Table:
    """Each check with the interval it was judged on (the delta's for a rule relative to the
    baseline, else the value's), the bound the verdict rests on and the fail side's adjusted
    level; an inconclusive check names the split size that would likely settle it."""
    rows = []
    for g in guards:
        interval = "-" if g.ci_low is None else f"[{g.ci_low:+.4f}, {g.ci_high:+.4f}]"
        judged = "-" if g.judged_bound is None else f"{g.judged_bound:+.4f}"
        level = "-" if g.adjusted_level is None else f"{g.adjusted_level:.3g}"
        note = g.note or ""
        if g.settle_n:
            note = f"about {g.settle_n} examples would likely settle it"
        verdict = _VERDICT[g.outcome]
        rows.append([g.rule, g.item or "", fmt(g.value), interval, judged, level, verdict, note])
    columns = ["rule", "item", "value", "interval", "bound", "adj. level"]
    columns += ["verdict", "note"]
    if not any(r[-1] for r in rows):  # no notes: the rule keeps the column's width
        columns, rows = columns[:-1], [r[:-1] for r in rows]
    return table("guardrails", columns, rows)


def _per_item_table(title: str, what: str, items: dict[str, dict[str, Delta]]) -> Table:
    """One row per category or field path, its metrics stacked in the row: the deltas keep
    their width and the item's column takes the rest, folding a long path, never cutting it."""
    t = Table(title=title, title_justify="left", show_lines=True)
    t.add_column(what, overflow="fold")
    t.add_column("metric", no_wrap=True)
    t.add_column("delta [95% CI]", no_wrap=True)
    for item, by_metric in items.items():
        t.add_row(
            item,
            "\n".join(by_metric),
            "\n".join(_delta(v) for v in by_metric.values()),
        )
    return t


def _run_label(run: CompareEntry) -> str:
    """The name the user gave (if any) above the full run id: ids are never cut."""
    return f"{run.name}\n{run.run_id}" if run.name else run.run_id


def _summary_table(record: Compare) -> tuple[Table, list[str]]:
    """One row per run (fits 80 columns); the reasons and flags as lines beneath it."""
    from tunelab.stages.compare.stage import interval_verdict

    t = Table(
        title=f"runs vs baseline: {record.primary_metric} "
        f"(min improvement {record.min_improvement or 0.0:g})",
        title_justify="left",
    )
    ids = [len(r.run_id) for r in record.runs] or [3]
    t.add_column("run", no_wrap=True, min_width=max(ids))
    t.add_column("delta [95% CI]", min_width=18)
    t.add_column("CI vs 0", no_wrap=True)
    t.add_column("≥ min", no_wrap=True)
    t.add_column("guards", no_wrap=True)
    t.add_column("decision", no_wrap=True)
    notes = []
    for run in record.runs:
        if not run.compared:
            t.add_row(_run_label(run), f"not compared ({run.status})", "-", "-", "-", "-")
            notes.append(f"{run.label}: {run.not_compared_reason}")
            continue
        p = run.primary
        meets = p.meets_min_improvement
        t.add_row(
            _run_label(run),
            _delta(p).replace(" [", "\n[", 1),
            interval_verdict(p.raw),
            "yes" if meets else ("no" if meets is not None else "-"),
            _VERDICT[run.guardrails_outcome],
            run.decision or "-",
        )
        notes.extend(f"{run.label}: {run.decision}: {r}" for r in run.decision_reasons or [])
        notes.extend(f"{run.label}: flag: {flag}" for flag in run.flags or [])
    return t, notes


def print_compare(record: Compare) -> None:
    base, primary = record.baseline, record.primary_metric
    if base is not None:
        console.print(
            f"baseline {base.run_id} on {record.split} ({base.n} examples), "
            f"primary metric {primary} = {fmt((base.metrics or {}).get(primary))}"
        )
    summary, notes = _summary_table(record)
    console.print(summary)
    tests = record.tests
    console.print(
        "CI vs 0: where the delta's 95% interval lies (only above 0 is a significant gain); "
        "≥ min: the delta reaches the registered minimum improvement"
    )
    if tests.raw:
        console.print(
            f"tests: {tests.level:.0%} paired intervals, each one-sided test at "
            f"{tests.one_sided:.3g}; a guardrail passes on its interval's bound at that level "
            f"and fails at the {tests.multiplicity}-adjusted level shown; goal "
            f"{tests.goal}; decision: {record.decision}"
        )
    for note in notes:
        console.print(f"  {note}")
    for run in record.runs:
        if run.compared:
            _print_run(run)


@app.command()
def compare(
    run_ids: Annotated[
        list[str] | None, typer.Argument(help="Runs to compare (default: every training run).")
    ] = None,
    study: StudyDir = Path("."),
    split: Annotated[str, typer.Option(help="validation or test.")] = "validation",
    baseline: Annotated[
        str | None, typer.Option(help="Baseline run (default: the latest completed one).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Runs against the baseline: deltas with paired 95% intervals, guardrails, flips, diffs."""
    from tunelab.stages.compare import stage as compare_stage
    from tunelab.stages.compare.stage import save_compare

    s = open_study(study, None)
    record = compare_stage.run(s, run_ids or None, split=split, baseline=baseline)
    path = save_compare(s, record)
    typed = Compare.of(path, record)
    for w in typed.warnings or []:
        console_err.print(f"[bold red on white] WARNING [/] [bold red]{w}[/]")
    if json_out:
        emit_json({"record": str(path), **record})
        return
    print_compare(typed)
    console.print(f"record: {path}")
