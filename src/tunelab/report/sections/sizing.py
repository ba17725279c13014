"""The dossier's section on the latest sizing: each measured configuration and the
recommendation."""

from __future__ import annotations

from tunelab.report.document import Section
from tunelab.report.sections.context import Dossier


def sizing_section(d: Dossier) -> Section:
    sec = Section("Sizing of a training step")
    if not d.data["sizing"]:
        sec.text("No sizing recorded.")
    for s in d.data["sizing"][-1:]:
        rows = []
        for c in s.get("configurations", s.get("rows", [])):
            rows.append(
                [
                    c.get("label") or c.get("name") or c.get("options"),
                    c.get("seq_len"),
                    c.get("micro_batch"),
                    c.get("predicted_mb") or (c.get("predicted") or {}).get("total_mb"),
                    c.get("measured_mb") or (c.get("measured") or {}).get("peak_mb"),
                    c.get("error_pct"),
                    c.get("step_s") or (c.get("measured") or {}).get("step_s"),
                    c.get("status", ""),
                ]
            )
        sec.table(
            [
                "configuration",
                "seq len",
                "micro-batch",
                "predicted MB",
                "measured MB",
                "error %",
                "step s",
                "status",
            ],
            rows,
        )
        rec = s.get("recommendation")
        if rec:
            sec.table(
                ["recommendation", "value"],
                [[k, v] for k, v in rec.items() if not isinstance(v, dict | list)],
            )
    return sec
