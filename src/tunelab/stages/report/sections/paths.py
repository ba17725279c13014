"""The dossier's section on extraction scores per schema path (nested objects and lists).

Built from evaluation records only: each record's `metrics.per_field` holds one row per path
(see tunelab.lib.metrics.extraction_metrics). Shown when a schema has more than flat fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tunelab.core.record_types import Evaluation
from tunelab.stages.report.document import Section
from tunelab.stages.report.plots import plot_grouped_bars

_FAILURES = ("missing", "wrong_type", "wrong_value", "not_json")


def _paths(records: Sequence[tuple[str, Evaluation]]) -> dict[str, str]:
    """path -> kind, in the order the records list them."""
    out: dict[str, str] = {}
    for _, rec in records:
        for path, row in rec.per_field.items():
            out.setdefault(path, row.kind or "value")
    return out


def path_section(runs: Sequence[tuple[str, Evaluation]], plot_dir: Path) -> Section | None:
    """'Extraction scores per path' for (run label, evaluation record) pairs, baseline first:
    the match rate and F1 of every path as tables and bars, and the failures by kind of the
    first and last run. None unless a record scores a nested or list path."""
    records = [(name, rec) for name, rec in runs if rec.task_kind == "extraction"]
    paths = _paths(records)
    if not any(kind != "value" or "." in p or "[]" in p for p, kind in paths.items()):
        return None
    sec = Section("Extraction scores per path")
    sec.text(
        "Match: the share of a path's slots whose answer matches the gold value by the scoring "
        "rules (a list matches when its items pair one to one with the gold items; the fields "
        "of list items, `path[].field`, are judged on paired items only). F1: items for a list "
        "path, present values elsewhere."
    )
    names = [name for name, _ in records]
    for stat, title, file in (
        ("normalized_match", "match per path", "paths_match.png"),
        ("f1", "F1 per path", "paths_f1.png"),
    ):
        series: dict[str, list[float | None]] = {}
        for name, rec in records:
            per = rec.per_field
            series[name] = [getattr(per[p], stat) if p in per else None for p in paths]
        last = records[-1][1].per_field
        slots = [last[p].slots if p in last else None for p in paths]
        sec.table(
            ["path", "kind", *names, f"slots ({names[-1]})"],
            [
                [p, kind, *(series[n][j] for n in names), slots[j]]
                for j, (p, kind) in enumerate(paths.items())
            ],
            caption=title,
        )
        sec.image(plot_grouped_bars(list(paths), series, title, stat, plot_dir / file), title)
    for idx in sorted({0, len(records) - 1}):
        name, rec = records[idx]
        per = rec.per_field
        rows = []
        for p in paths:
            failures = (per[p].failures if p in per else None) or {}
            rows.append([p, *(failures.get(k, 0) for k in _FAILURES)])
        sec.table(["path", *_FAILURES], rows, caption=f"{name}: failed slots by kind")
    return sec
