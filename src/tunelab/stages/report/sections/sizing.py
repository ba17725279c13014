"""The dossier's section on the latest sizing: each measured configuration and the
recommendation, in MiB, GiB, seconds and percent (the exact figures on hover)."""

from __future__ import annotations

from tunelab.stages.report.document import Section, Value
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.units import by_key, mib, percent, seconds


def _name(key: str) -> str:
    """A record's key in words; the unit it names is in the value."""
    for unit in ("_bytes", "_s"):
        if key.endswith(unit) and key != "tokens_per_s":
            key = key.removesuffix(unit)
    return key.replace("_", " ")


def _recommended(key: str, v: object, images: bool) -> list[object]:
    """A recommendation's row; an image model's `tokens_per_s` counts images (its batches do)."""
    if key == "tokens_per_s" and images and isinstance(v, int | float):
        return ["images per s", Value(f"{v:,.0f} images/s", v)]
    return [_name(key), by_key(key, v)]


def sizing_section(d: Dossier) -> Section:
    sec = Section("Sizing of a training step")
    if not d.data.sizing:
        sec.text("No sizing recorded.")
    for s in d.data.sizing[-1:]:
        if stale := d.made_under(s.raw):
            sec.text(f"This sizing was {stale}.")
        cuda = s.device == "cuda"
        images = s.architecture == "image"
        length = {"image side": "px a side", "patch tokens": "patch tokens"}.get(
            s.length_unit, "tokens"
        )
        rows = [
            [
                c.title,
                c.seq_len,
                c.micro_batch,
                mib(c.predicted_peak_mb),
                mib(c.measured_peak_mb),
                percent(c.error_pct, signed=True),
                seconds(c.measured_step_s),
                c.status or "",
            ]
            for c in s.rows
        ]
        what = "peak allocated" if cuda else "what a step adds to the idle process's RSS"
        sec.table(
            ["configuration", f"seq len ({length})", "micro-batch", "predicted", "measured"]
            + ["error", "step", "status"],
            rows,
            caption=f"predicted vs measured: {what}",
        )
        rec = s.recommendation
        if rec:
            sec.table(
                ["recommendation", "value"],
                [
                    _recommended(k, v, images)
                    for k, v in rec.items()
                    if not isinstance(v, dict | list)
                ],
                caption="the recommendation (predicted peak: the whole process, against the "
                "budget)",
            )
    return sec
