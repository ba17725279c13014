"""The dossier's section on the latest comparison: each variant's deltas with their intervals,
per-category or per-field deltas, McNemar, guardrails, flipped examples (with thumbnails for an
image study) and the config diff."""

from __future__ import annotations

from typing import Any

from tunelab.stages.report.decision import format_ci
from tunelab.stages.report.document import Section, cell_text
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.sections.flipped_images import flipped_galleries
from tunelab.stages.report.units import p_value


def _per_item(sec: Section, name: str, v: dict[str, Any]) -> None:
    for key, label in (("per_category", "category"), ("per_field", "field")):
        per = v.get(key) or {}
        if not per:
            continue
        stat = "f1" if key == "per_category" else "exact_match"
        sec.table(
            [label, f"baseline {stat}", f"variant {stat}", "delta", "95% CI"],
            [
                [
                    item,
                    (m.get(stat) or {}).get("baseline"),
                    (m.get(stat) or {}).get("variant"),
                    (m.get(stat) or {}).get("delta"),
                    format_ci(m.get(stat) or {}),
                ]
                for item, m in per.items()
            ],
            caption=f"{name}: {stat} per {label}",
        )


def _guardrail_table(guards: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of the guardrail checks; a record with verdicts adds the interval
    judged, the bound the verdict rests on and the fail side's adjusted level."""
    judged = any("verdict" in g for g in guards)
    columns = ["rule", "item", "value", "bound"]
    columns += ["interval", "judged bound", "adjusted level", "verdict"] if judged else ["verdict"]
    rows = []
    for g in guards:
        row = [g.get("rule"), g.get("item") or "overall", g.get("value"), g.get("bound")]
        if judged:
            row += [
                format_ci(g),
                "-" if g.get("judged_bound") is None else f"{g['judged_bound']:+.4f}",
                "-" if g.get("adjusted_level") is None else f"{g['adjusted_level']:.3g}",
            ]
        rows.append(row + [g.get("verdict") or ("pass" if g.get("pass") else "fail")])
    return columns, rows


def _guardrails_and_flips(sec: Section, name: str, v: dict[str, Any], flipped: list) -> None:
    guards = v.get("guardrails") or []
    if guards:
        sec.table(*_guardrail_table(guards), caption=f"{name} guardrails")
    fl = v.get("flips") or {}
    if fl:
        sec.table(
            ["direction", "count", "example ids (first 10)"],
            [
                [k, len(fl.get(k) or []), ", ".join(map(str, (fl.get(k) or [])[:10]))]
                for k in ("improved", "regressed")
            ],
            caption=f"{name} flipped examples",
        )
    sec.blocks.extend(flipped)  # an image study's thumbnails of them


def _variant(sec: Section, v: dict[str, Any], flipped: list) -> None:
    name = v.get("name") or v.get("run_id")
    if not v.get("compared"):
        sec.text(
            f"{name} ({v.get('run_id')}): not compared - {v.get('not_compared_reason') or v.get('reason') or v.get('status')}"
        )
        return
    rows = [
        [k, m.get("baseline"), m.get("variant"), m.get("delta"), format_ci(m)]
        for k, m in (v.get("metrics") or {}).items()
        if isinstance(m, dict)
    ]
    sec.table(
        ["metric", "baseline", "variant", "delta", "95% CI"],
        rows,
        caption=f"{name} ({v.get('run_id')}) against the baseline",
    )
    _per_item(sec, name, v)
    mc = v.get("mcnemar") or {}
    if mc:
        sec.text(
            f"{name}: McNemar ({mc.get('method', '')}) p = {cell_text(p_value(mc.get('p_value')))}, "
            f"{mc.get('b', mc.get('improved', '-'))}/{mc.get('c', mc.get('regressed', '-'))} discordant."
        )
    _guardrails_and_flips(sec, name, v, flipped)
    diff = (v.get("config_diff") or {}).get("changes") or []
    if diff:
        sec.table(
            ["group", "field", "parent", "variant"],
            [[c.get("group"), c.get("path"), c.get("old"), c.get("new")] for c in diff],
            caption=f"{name}: config against {(v.get('config_diff') or {}).get('against')}",
        )
    for flag in v.get("flags") or []:
        sec.text(f"warning ({name}): {flag}")


def comparisons_section(d: Dossier) -> Section:
    sec = Section("Comparisons and guardrails")
    if not d.data["compares"]:
        sec.text("No comparison recorded.")
    for cmp in d.data["compares"][-1:]:
        base = cmp.get("baseline") or {}
        sec.text(
            f"Baseline {base.get('run_id')} ({base.get('n')} examples); paired bootstrap "
            f"{(cmp.get('bootstrap') or {}).get('samples')} samples, 95 % intervals."
        )
        if stale := d.made_under(cmp):
            sec.text(
                f"This comparison was {stale} (`tunelab compare` applies the current guardrails "
                "and decision rule)."
            )
        for w in cmp.get("warnings") or []:
            sec.text(f"warning: {w}")
        for v in cmp.get("runs", []):
            _variant(sec, v, flipped_galleries(d, cmp, v) if v.get("compared") else [])
    return sec
