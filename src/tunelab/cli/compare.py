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


def _delta(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("delta") is None:
        return "-"
    text = f"{entry['delta']:+.4f}"
    if entry.get("ci_low") is not None:
        text += f" [{entry['ci_low']:+.4f}, {entry['ci_high']:+.4f}]"
    return text


def _ids(count: int, what: str, ids: list[Any], shown: int = 8) -> str:
    """`69 improved: a, b, ... (61 more)`: the first ids of a flip list, comma-separated."""
    if not count:
        return f"0 {what}"
    more = f" ({count - shown} more)" if count > shown else ""
    return f"{count} {what}: " + ", ".join(map(str, ids[:shown])) + more


def _print_run(run: dict[str, Any]) -> None:
    name = f"{run['name']}  " if run.get("name") else ""
    console.print(f"\n[bold]{name}{run['run_id']}[/]")
    rows = [
        [
            m,
            fmt(v["baseline"]),
            fmt(v["variant"]),
            _delta(v),
        ]
        for m, v in run["metrics"].items()
    ]
    console.print(table("vs baseline", ["metric", "baseline", "run", "delta [95% CI]"], rows))
    mc = run["mcnemar"]
    console.print(
        f"McNemar ({mc['method']}): {mc['c']} examples improved, {mc['b']} regressed, "
        f"p = {mc['p_value']:.4g}"
    )
    for key, what in (("per_category", "category"), ("per_field", "field")):
        if run.get(key):
            console.print(_per_item_table(f"per {what} delta [95% CI]", what, run[key]))
    console.print(_guardrail_table(run["guardrails"]))
    fl = run["flips"]
    console.print(
        f"flips: {_ids(fl['num_improved'], 'improved', fl['improved'])}; "
        f"{_ids(fl['num_regressed'], 'regressed', fl['regressed'])}"
    )
    diff = run["config_diff"]
    shown = lambda v: "null" if v is None else v  # noqa: E731
    changes = [[c["group"], c["path"], shown(c["old"]), shown(c["new"])] for c in diff["changes"]]
    if changes:
        console.print(f"config diff against {diff['against']}:")
        console.print(table(None, ["group", "path", "was", "now"], changes))
    else:
        console.print(f"config diff against {diff['against']}: no difference")
    if run.get("why"):
        console.print(f"why: {run['why']}")
    for flag in run["flags"]:
        console.print(f"[bold yellow]flag:[/] {flag}")
    for note in run.get("notes") or []:
        console.print(f"note: {note}")


_VERDICT = {
    "pass": "[green]pass[/]",
    "fail": "[red]FAIL[/]",
    "inconclusive": "[yellow]inconclusive[/]",
}


def _verdict(g: dict[str, Any]) -> str:
    return _VERDICT[g.get("verdict") or ("pass" if g.get("pass") else "fail")]


def _guardrail_table(guards: list[dict[str, Any]]) -> Table:
    """Each check with the interval it was judged on (the delta's for a rule relative to the
    baseline, else the value's), the bound the verdict rests on and the fail side's adjusted
    level; an inconclusive check names the split size that would likely settle it."""
    rows = []
    for g in guards:
        interval = "-" if g.get("ci_low") is None else f"[{g['ci_low']:+.4f}, {g['ci_high']:+.4f}]"
        judged = "-" if g.get("judged_bound") is None else f"{g['judged_bound']:+.4f}"
        level = "-" if g.get("adjusted_level") is None else f"{g['adjusted_level']:.3g}"
        note = g.get("note") or ""
        if g.get("settle_n"):
            note = f"about {g['settle_n']} examples would likely settle it"
        rows.append(
            [
                g["rule"],
                g["item"] or "",
                fmt(g["value"]),
                interval,
                judged,
                level,
                _verdict(g),
                note,
            ]
        )
    columns = ["rule", "item", "value", "interval", "bound", "adj. level"]
    columns += ["verdict", "note"]
    if not any(r[-1] for r in rows):  # no notes: the rule keeps the column's width
        columns, rows = columns[:-1], [r[:-1] for r in rows]
    return table("guardrails", columns, rows)


def _per_item_table(title: str, what: str, items: dict[str, dict[str, Any]]) -> Table:
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


def _run_label(run: dict[str, Any]) -> str:
    """The name the user gave (if any) above the full run id: ids are never cut."""
    return f"{run['name']}\n{run['run_id']}" if run.get("name") else run["run_id"]


def _summary_table(record: dict[str, Any]) -> tuple[Table, list[str]]:
    """One row per run (fits 80 columns); the reasons and flags as lines beneath it."""
    from tunelab.stages.compare.stage import interval_verdict

    primary = record["primary_metric"]
    t = Table(
        title=f"runs vs baseline: {primary} (min improvement {record['min_improvement']:g})",
        title_justify="left",
    )
    ids = [len(r["run_id"]) for r in record["runs"]] or [3]
    t.add_column("run", no_wrap=True, min_width=max(ids))
    t.add_column("delta [95% CI]", min_width=18)
    t.add_column("CI vs 0", no_wrap=True)
    t.add_column("≥ min", no_wrap=True)
    t.add_column("guards", no_wrap=True)
    t.add_column("decision", no_wrap=True)
    notes = []
    for run in record["runs"]:
        who = run.get("name") or run["run_id"]
        if not run["compared"]:
            t.add_row(_run_label(run), f"not compared ({run['status']})", "-", "-", "-", "-")
            notes.append(f"{who}: {run['not_compared_reason']}")
            continue
        p = run["primary"]
        meets = p.get("meets_min_improvement")
        t.add_row(
            _run_label(run),
            _delta(p).replace(" [", "\n[", 1),
            interval_verdict(p),
            "yes" if meets else ("no" if meets is not None else "-"),
            _verdict({"verdict": run.get("guardrails_verdict"), "pass": run["guardrails_pass"]}),
            run.get("decision") or "-",
        )
        notes.extend(
            f"{who}: {run.get('decision')}: {r}" for r in run.get("decision_reasons") or []
        )
        notes.extend(f"{who}: flag: {flag}" for flag in run["flags"])
    return t, notes


def print_compare(record: dict[str, Any]) -> None:
    base = record["baseline"]
    primary = record["primary_metric"]
    console.print(
        f"baseline {base['run_id']} on {record['split']} ({base['n']} examples), "
        f"primary metric {primary} = {fmt(base['metrics'].get(primary))}"
    )
    summary, notes = _summary_table(record)
    console.print(summary)
    tests = record.get("tests") or {}
    console.print(
        "CI vs 0: where the delta's 95% interval lies (only above 0 is a significant gain); "
        "≥ min: the delta reaches the registered minimum improvement"
    )
    if tests:
        console.print(
            f"tests: {tests['confidence']:.0%} paired intervals, each one-sided test at "
            f"{tests['alpha']:.3g}; a guardrail passes on its interval's bound at that level "
            f"and fails at the {tests['multiplicity']}-adjusted level shown; goal "
            f"{tests['goal']}; decision: {record.get('decision')}"
        )
    for note in notes:
        console.print(f"  {note}")
    for run in record["runs"]:
        if run["compared"]:
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
    for w in record["warnings"]:
        console_err.print(f"[bold red on white] WARNING [/] [bold red]{w}[/]")
    if json_out:
        emit_json({"record": str(path), **record})
        return
    print_compare(record)
    console.print(f"record: {path}")
