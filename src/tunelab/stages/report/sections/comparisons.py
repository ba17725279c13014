"""The dossier's section on the latest comparison: each variant's deltas with their intervals,
per-category or per-field deltas, McNemar, guardrails, flipped examples (with thumbnails for an
image study) and the config diff."""

from __future__ import annotations

from typing import Any

from tunelab.core.record_parts import CompareEntry, GuardrailVerdict
from tunelab.stages.report.decision import format_ci
from tunelab.stages.report.document import Section, cell_text
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.sections.flipped_images import flipped_galleries
from tunelab.stages.report.units import p_value


def _per_item(sec: Section, name: str, v: CompareEntry) -> None:
    for per, label, stat in (
        (v.per_category, "category", "f1"),
        (v.per_field, "field", "exact_match"),
    ):
        if not per:
            continue
        cells = {item: m.get(stat) for item, m in per.items()}
        sec.table(
            [label, f"baseline {stat}", f"variant {stat}", "delta", "95% CI"],
            [
                [item, *((c.baseline, c.variant, c.delta) if c else (None,) * 3), format_ci(c)]
                for item, c in cells.items()
            ],
            caption=f"{name}: {stat} per {label}",
        )


def _guardrail_table(guards: list[GuardrailVerdict]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of the guardrail checks; a record with verdicts adds the interval
    judged, the bound the verdict rests on and the fail side's adjusted level."""
    judged = any(g.verdict is not None for g in guards)
    columns = ["rule", "item", "value", "bound"]
    columns += ["interval", "judged bound", "adjusted level", "verdict"] if judged else ["verdict"]
    rows = []
    for g in guards:
        row = [g.rule, g.item or "overall", g.value, g.bound]
        if judged:
            row += [
                format_ci(g),
                "-" if g.judged_bound is None else f"{g.judged_bound:+.4f}",
                "-" if g.adjusted_level is None else f"{g.adjusted_level:.3g}",
            ]
        rows.append(row + [g.outcome])
    return columns, rows


def _guardrails_and_flips(sec: Section, name: str, v: CompareEntry, flipped: list) -> None:
    if v.guardrails:
        sec.table(*_guardrail_table(v.guardrails), caption=f"{name} guardrails")
    if v.flips.raw:
        ids = {"improved": v.flips.improved or [], "regressed": v.flips.regressed or []}
        sec.table(
            ["direction", "count", "example ids (first 10)"],
            [[k, len(ids[k]), ", ".join(map(str, ids[k][:10]))] for k in ids],
            caption=f"{name} flipped examples",
        )
    sec.blocks.extend(flipped)  # an image study's thumbnails of them


def _variant(sec: Section, v: CompareEntry, flipped: list) -> None:
    name = v.label
    if not v.compared:
        sec.text(
            f"{name} ({v.run_id}): not compared - {v.not_compared_reason or v.reason or v.status}"
        )
        return
    rows = [[k, m.baseline, m.variant, m.delta, format_ci(m)] for k, m in v.metrics.items()]
    sec.table(
        ["metric", "baseline", "variant", "delta", "95% CI"],
        rows,
        caption=f"{name} ({v.run_id}) against the baseline",
    )
    _per_item(sec, name, v)
    if (mc := v.mcnemar) is not None and mc.raw:
        b = mc.b if mc.b is not None else mc.improved
        c = mc.c if mc.c is not None else mc.regressed
        sec.text(
            f"{name}: McNemar ({mc.method or ''}) p = {cell_text(p_value(mc.p_value))}, "
            f"{'-' if b is None else b}/{'-' if c is None else c} discordant."
        )
    _guardrails_and_flips(sec, name, v, flipped)
    diff = v.config_diff
    if diff is not None and diff.changes:
        sec.table(
            ["group", "field", "parent", "variant"],
            [[c.group, c.key, c.old, c.new] for c in diff.changes],
            caption=f"{name}: config against {diff.against}",
        )
    for flag in v.flags or []:
        sec.text(f"warning ({name}): {flag}")


def comparisons_section(d: Dossier) -> Section:
    sec = Section("Comparisons and guardrails")
    if not d.data.compares:
        sec.text("No comparison recorded.")
    for cmp in d.data.compares[-1:]:
        base = cmp.baseline
        sec.text(
            f"Baseline {base.run_id if base else None} ({base.n if base else None} examples); "
            f"paired bootstrap {(cmp.bootstrap or {}).get('samples')} samples, "
            "95 % intervals."
        )
        if stale := d.made_under(cmp.raw):
            sec.text(
                f"This comparison was {stale} (`tunelab compare` applies the current guardrails "
                "and decision rule)."
            )
        for w in cmp.warnings or []:
            sec.text(f"warning: {w}")
        for v in cmp.runs:
            _variant(sec, v, flipped_galleries(d, cmp, v) if v.compared else [])
    return sec
