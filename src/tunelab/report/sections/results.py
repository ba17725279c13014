"""The dossier's section on the baseline and the variants on the validation split: overall
metrics, then the per-category (classification) or per-field (extraction) scores as a table and
bars."""

from __future__ import annotations

from typing import Any

from tunelab.report.document import Section
from tunelab.report.plots import plot_grouped_bars
from tunelab.report.sections.context import Dossier

_FIELD_STATS = ("exact_match", "normalized_match", "presence_rate")


def _metric_names(evaluated: dict[str, dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for ev in evaluated.values():
        for k, v in (ev.get("metrics") or {}).items():
            if (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and k not in names
                and k != "n"
            ):
                names.append(k)
    return names


def _per_group(d: Dossier, sec: Section, key: str, title: str) -> None:
    """One row per run, one column per category or field, and the same as bars."""
    groups: list[str] = []
    for i in d.order:
        for g in (d.evaluated[i].get("metrics") or {}).get(key) or {}:
            if g not in groups:
                groups.append(g)
    if not groups:
        return
    stat = "f1" if key == "per_category" else None
    series: dict[str, list[float | None]] = {}
    rows = []
    for i in d.order:
        per = (d.evaluated[i].get("metrics") or {}).get(key) or {}
        if stat is None:
            first = next(iter(per.values()), {})
            stat = next((s for s in _FIELD_STATS if s in first), None)
        values = [(per.get(g) or {}).get(stat) if stat else None for g in groups]
        series[d.label(i)] = values
        rows.append([d.label(i), *values])
    sec.table(["run", *groups], rows, caption=f"{stat} {title}")
    img = plot_grouped_bars(
        groups, series, f"{stat} {title}", stat or "", d.plot_dir / f"{key}.png"
    )
    sec.image(img, f"{stat} {title}")


def results_section(d: Dossier) -> Section:
    sec = Section("Baseline and variants on the validation split")
    if not d.evaluated:
        return sec.text("No evaluation recorded yet (`tunelab baseline`, `tunelab eval RUN`).")
    metric_names = _metric_names(d.evaluated)
    sec.table(
        ["run", "kind", "n", *metric_names],
        [
            [
                d.label(i),
                d.runs_by_id.get(i, {"row": {"kind": "?"}})["row"]["kind"],
                d.evaluated[i].get("n"),
                *[(d.evaluated[i].get("metrics") or {}).get(k) for k in metric_names],
            ]
            for i in d.order
        ],
    )
    for key, title in (("per_category", "F1 per category"), ("per_field", "per field")):
        _per_group(d, sec, key, title)
    return sec
