"""The dossier's section on the baseline and the variants on the validation split: overall
metrics, the per-category (classification) or per-field (extraction) scores as a table and
bars, and each run's confusion matrix.

Runs are columns and metrics, categories or fields rows: a study has a few runs and may have
dozens of categories, and a page has room for few columns.
"""

from __future__ import annotations

from tunelab.core.record_parts import Confusion
from tunelab.core.record_types import Evaluation
from tunelab.stages.report.document import Section, Value
from tunelab.stages.report.plots import plot_grouped_bars
from tunelab.stages.report.sections.context import Dossier

_FIELD_STATS = ("exact_match", "normalized_match", "presence_rate")
_STAT_NAMES = {"f1": "F1", "exact_match": "exact match", "normalized_match": "normalized match"}


def _metric_names(evaluated: dict[str, Evaluation]) -> list[str]:
    names: list[str] = []
    for ev in evaluated.values():
        for k, v in ev.metrics.items():
            if (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and k not in names
                and k != "n"
            ):
                names.append(k)
    return names


def _per_group(d: Dossier, sec: Section, key: str, unit: str) -> None:
    """One row per category or field, one column per run, and the same as bars."""
    groups: list[str] = []
    for i in d.order:
        for g in d.evaluated[i].metrics.get(key) or {}:
            if g not in groups:
                groups.append(g)
    if not groups:
        return
    stat = "f1" if key == "per_category" else None
    series: dict[str, list[float | None]] = {}
    for i in d.order:
        per = d.evaluated[i].metrics.get(key) or {}
        if stat is None:
            first = next(iter(per.values()), {})
            stat = next((s for s in _FIELD_STATS if s in first), None)
        series[d.label(i)] = [(per.get(g) or {}).get(stat) if stat else None for g in groups]
    title = f"{_STAT_NAMES.get(stat or '', stat)} per {unit}"
    sec.table(
        [unit, *series],
        [[g, *(values[j] for values in series.values())] for j, g in enumerate(groups)],
        caption=f"{title} (0 to 1)",
    )
    img = plot_grouped_bars(groups, series, title, stat or "", d.plot_dir / f"{key}.png")
    sec.image(img, title)


def _confusion(sec: Section, name: str, conf: Confusion | None) -> None:
    """Gold categories as rows, predictions as columns numbered as the rows (the full name on
    hover), so that 40 categories need 40 narrow columns, not 40 names across."""
    if conf is None:
        return
    labels, predicted, matrix = conf.labels, conf.predicted, conf.matrix
    if not labels or not predicted or not matrix:
        return
    number = {label: str(i + 1) for i, label in enumerate(labels)}
    columns: list[str | Value] = ["gold \\ predicted"]
    columns += [Value(number.get(p, p), p) for p in predicted]
    rows = [
        [f"{i + 1}. {label}", *counts]
        for i, (label, counts) in enumerate(zip(labels, matrix, strict=False))
    ]
    sec.table(columns, rows, caption=f"{name}: confusion matrix (examples; rows: gold)")


def _version(d: Dossier, ev: Evaluation) -> str:
    version, _ = d.version_of(ev.raw)
    return "-" if version is None else f"v{version}"


def _stale_evaluations(d: Dossier) -> dict[str, list[str]]:
    """Each note ("made under hypothesis v1; current is v2") -> the runs it is about."""
    out: dict[str, list[str]] = {}
    for i in d.order:
        if note := d.made_under(d.evaluated[i].raw):
            out.setdefault(note, []).append(d.label(i))
    return out


def results_section(d: Dossier) -> Section:
    sec = Section("Baseline and variants on the validation split")
    if not d.evaluated:
        return sec.text("No evaluation recorded yet (`tunelab baseline`, `tunelab eval RUN`).")
    metric_names = _metric_names(d.evaluated)
    metrics = {i: d.evaluated[i].metrics for i in d.order}
    stale = _stale_evaluations(d)
    versions = [["hypothesis", *(_version(d, d.evaluated[i]) for i in d.order)]] if stale else []
    sec.table(
        ["metric", *(d.label(i) for i in d.order)],
        [
            [
                "kind",
                *(r.row.kind if (r := d.runs_by_id.get(i)) else "?" for i in d.order),
            ],
            ["examples", *(d.evaluated[i].n for i in d.order)],
            *versions,
            *([k, *(metrics[i].get(k) for i in d.order)] for k in metric_names),
        ],
        caption="overall metrics (shares of 0 to 1 unless named otherwise)",
    )
    for note, labels in stale.items():
        many = len(labels) > 1
        names = " and ".join([", ".join(labels[:-1]), labels[-1]] if many else labels)
        sec.text(
            f"The evaluation{'s' if many else ''} of {names} {'were' if many else 'was'} {note}."
        )
    _per_group(d, sec, "per_category", "category")
    _per_group(d, sec, "per_field", "field")
    for i in d.order:
        _confusion(sec, d.label(i), d.evaluated[i].confusion)
    return sec
