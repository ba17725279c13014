"""The dossier's section listing every run, failed ones included, and the loss curves."""

from __future__ import annotations

from tunelab.report.document import Section
from tunelab.report.plots import plot_loss_curves
from tunelab.report.sections.context import Dossier, short


def runs_section(d: Dossier) -> Section:
    sec = Section("Every run, failed ones included")
    sec.table(
        [
            "id",
            "kind",
            "name",
            "parent",
            "status",
            "reason",
            "why",
            "config sha",
            "created",
            "finished",
        ],
        [
            [
                r["row"]["id"],
                r["row"]["kind"],
                r["row"]["name"],
                r["row"]["parent"],
                r["row"]["status"],
                r["row"]["reason"],
                r["row"]["why"],
                short(r["row"]["config_sha"]),
                r["row"]["created_at"],
                r["row"]["finished_at"],
            ]
            for r in d.runs
        ],
    )
    train_runs = [r for r in d.runs if r["row"]["kind"] == "train"]
    return sec.image(plot_loss_curves(train_runs, d.plot_dir / "loss_curves.png"), "loss curves")
