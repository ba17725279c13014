"""The dossier's section listing every run, failed ones included, their interruptions and
resumes, and the loss curves."""

from __future__ import annotations

import re
from typing import Any

from tunelab.core.ledger import LedgerEvent, RunRow
from tunelab.stages.report.collect import RunEvidence
from tunelab.stages.report.document import Section
from tunelab.stages.report.plots import plot_loss_curves
from tunelab.stages.report.sections.context import Dossier, short


def stops_and_resumes(events: list[LedgerEvent]) -> list[dict[str, Any]]:
    """A run's interruptions from its ledger events, oldest first, each with the resume that
    followed it: `{at, reason, resumed_at, resumed}` (`resumed` as "from step-000002" or "from
    the start (no checkpoint yet)"; the last two None while it is not resumed)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.kind == "status:interrupted":
            out.append({"at": e.at, "reason": e.detail, "resumed_at": None, "resumed": None})
        elif e.kind == "status:running" and out and out[-1]["resumed_at"] is None:
            # a status "running" after the start is only ever set by a resume
            detail = str(e.detail or "")
            out[-1].update(resumed_at=e.at, resumed=detail.removeprefix("resumed ") or None)
    return out


def resumed_steps(stops: list[dict[str, Any]]) -> list[int]:
    """The optimizer step each resume continued from (0: from the start)."""
    steps = []
    for s in stops:
        if s["resumed_at"] is not None:
            m = re.search(r"step-(\d+)", s["resumed"] or "")
            steps.append(int(m.group(1)) if m else 0)
    return steps


def _times(n: int) -> str:
    return f"{n} time" if n == 1 else f"{n} times"


def _history(label: str, run_id: str, stops: list[dict[str, Any]]) -> str:
    resumed = sum(s["resumed_at"] is not None for s in stops)
    parts = []
    for k, s in enumerate(stops, 1):
        number = f"{k}. i" if len(stops) > 1 else "I"
        part = f"{number}nterrupted at {s['at']} ({s['reason'] or 'no reason recorded'}), "
        if s["resumed_at"] is None:
            part += f"not resumed (`tunelab resume {run_id}` continues it)"
        elif s["resumed"]:
            part += f"resumed {s['resumed']} at {s['resumed_at']}"
        else:
            part += f"resumed at {s['resumed_at']}"
        parts.append(part)
    return (
        f"{label} ({run_id}): interrupted {_times(len(stops))} and resumed {_times(resumed)}. "
        + "; ".join(parts)
        + "."
    )


def adaptation_of(run: RunEvidence, by_id: dict[str, RunEvidence]) -> str:
    """How the model a run trained or evaluated was adapted, in a few words, from its recorded
    config: an evaluation's is its parent's, a baseline's the base (4-bit under QLoRA)."""
    if run.row.kind == "eval" and run.row.parent in by_id:
        run = by_id[run.row.parent]
    adaptation = run.config.adaptation if run.config else None
    method = adaptation.method if adaptation else None
    if not method:
        return "-"
    if run.row.kind == "baseline":
        return "base, 4-bit" if method == "qlora" else "base"
    if method not in ("lora", "qlora"):
        return method
    quant = adaptation.quant_type
    return f"{method} r{adaptation.rank}" + (f" {quant}" if method == "qlora" else "")


def runs_section(d: Dossier) -> Section:
    sec = Section("Every run, failed ones included")
    stops = {r.row.id: stops_and_resumes(r.events) for r in d.runs}
    by_id = {r.row.id: r for r in d.runs}

    def status(row: RunRow) -> str:
        resumed = len(resumed_steps(stops[row.id]))
        return row.status + (f", resumed {resumed}x" if resumed else "")

    sec.table(
        [
            "id",
            "kind",
            "adaptation",
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
                r.row.id,
                r.row.kind,
                adaptation_of(r, by_id),
                r.row.name,
                r.row.parent,
                status(r.row),
                r.row.reason,
                r.row.why,
                short(r.row.config_sha),
                r.row.created_at,
                r.row.finished_at,
            ]
            for r in d.runs
        ],
    )
    for r in d.runs:
        if stops[r.row.id]:
            sec.text(_history(r.label, r.row.id, stops[r.row.id]))
    stale: dict[str, list[str]] = {}
    for r in d.runs:
        if note := d.made_under(r.row.to_dict()):
            stale.setdefault(note, []).append(r.row.id)
    for note, ids in stale.items():
        sec.text(f"{'Run' if len(ids) == 1 else 'Runs'} {', '.join(ids)}: {note}.")
    train_runs = [r for r in d.runs if r.row.kind == "train"]
    resumes = {r.row.id: resumed_steps(stops[r.row.id]) for r in train_runs}
    loss = plot_loss_curves(train_runs, d.plot_dir / "loss_curves.png", resumes)
    return sec.image(loss, "loss curves")
