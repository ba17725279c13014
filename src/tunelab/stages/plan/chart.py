"""The plan's Gantt chart: the phases on a time axis in hours, margins hatched."""

from __future__ import annotations

from pathlib import Path

from tunelab.core.records import write_bytes_atomic
from tunelab.stages.plan.estimate import Plan

# beyond this many variants the experiments are one bar: a bar each would make a page-long image
MAX_VARIANT_BARS = 12


def draw_gantt(plan: Plan, path: Path) -> Path:
    """The phases on a time axis (hours), each variant a bar, margins hatched, the window's end."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "initial check": "#4C72B0",
        "experiments": "#55A868",
        "evaluation": "#8172B2",
        "resumption margin": "#CCB974",
        "export": "#C44E52",
    }
    rows: list[tuple[str, float, float, float, str]] = []  # label, start, length, margin, phase
    n = plan.num_variants
    for ph in plan.phases:
        name, start = ph.phase, ph.start_s / 3600
        if name == "experiments" and 0 < n <= MAX_VARIANT_BARS:
            each = ph.planned_s / n / 3600
            each_margin = ph.margin_s / n / 3600
            for i in range(n):
                rows.append((f"variant {i + 1}", start, each, each_margin, name))
                start += each + each_margin
        else:
            label = f"experiments ({n:,} variants)" if name == "experiments" else name
            rows.append((label, start, ph.planned_s / 3600, ph.margin_s / 3600, name))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    for y, (_label, start, length, margin, phase) in enumerate(rows):
        ax.barh(y, length, left=start, color=colours[phase], edgecolor="black", linewidth=0.4)
        if margin > 0:
            ax.barh(
                y,
                margin,
                left=start + length,
                color="white",
                edgecolor=colours[phase],
                hatch="///",
                linewidth=0.6,
            )
    window_h = plan.window_s / 3600
    end_h = plan.busy_s / 3600
    if window_h <= 1.5 * end_h:
        ax.axvline(window_h, color="red", linestyle="--", linewidth=1)
        ax.text(window_h, -0.8, " end of rental", color="red", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("hours from the start of the rental (hatched: margin)")
    status = "fits" if plan.fits else "DOES NOT FIT"
    ax.set_title(
        f"{plan.days}-day plan on {plan.device}: {end_h:.2f} h busy of "
        f"{window_h:.0f} h, {n} variants ({status}), {plan.cost.rental_cost:,.0f} rental",
        fontsize=9,
    )
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue())
