"""Plots of the dossier (matplotlib, Agg): loss curves and per-category / per-field bars."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from tunelab.stages.report.collect import RunEvidence


def plot_loss_curves(
    runs: list[RunEvidence], out: Path, resumed: dict[str, list[int]] | None = None
) -> Path | None:
    """One line per training run (train loss per step, validation loss as markers); a dotted
    vertical line at each step a run was resumed from (`resumed`: run id -> steps)."""
    series = [(r.label, r.steps, (resumed or {}).get(r.row.id, [])) for r in runs if r.steps]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, steps, resumes in series:
        xs = [s.step for s in steps if s.loss is not None]
        ys = [s.loss for s in steps if s.loss is not None]
        (line,) = ax.plot(xs, ys, label=f"{label} train", linewidth=1.2)
        vx = [s.step for s in steps if s.val_loss is not None]
        vy = [s.val_loss for s in steps if s.val_loss is not None]
        if vx:
            ax.plot(
                vx, vy, "o--", color=line.get_color(), label=f"{label} validation", markersize=4
            )
        for k, step in enumerate(resumes):
            ax.axvline(
                step,
                color=line.get_color(),
                linestyle=":",
                linewidth=1,
                label=f"{label} resumed" if k == 0 else None,
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (per loss token)")
    ax.set_title("Loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_grouped_bars(
    groups: list[str], series: dict[str, list[float | None]], title: str, ylabel: str, out: Path
) -> Path | None:
    """Bars per group (category or field), one colour per run (baseline first); horizontal,
    one line per group, past a dozen groups, so that every name stays readable."""
    if not groups or not series:
        return None
    n = len(series)
    width = 0.8 / n
    many = len(groups) > 12
    size = (
        (8, 0.2 * len(groups) * (1 + 0.25 * (n - 1)) + 1.5)
        if many
        else (max(6, 1.2 * len(groups) + 2), 4)
    )
    fig, ax = plt.subplots(figsize=size)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        heights = [v if v is not None else 0 for v in values]
        if many:
            ax.barh(xs, heights, width, label=name)
        else:
            ax.bar(xs, heights, width, label=name)
    if many:
        ax.set_yticks(range(len(groups)))
        ax.set_yticklabels(groups, fontsize=8)
        ax.set_ylim(len(groups) - 0.5, -0.5)  # the first group on top, as in the table
        ax.set_xlim(0, 1.05)
        ax.set_xlabel(ylabel)
        ax.grid(axis="x", alpha=0.3)
    else:
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=20, ha="right")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
