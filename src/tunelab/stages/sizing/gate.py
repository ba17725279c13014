"""The train-start check: the run's worst batch and its evaluation fit the sizing's budget.

`tunelab train` and `tunelab resume` call `require_peaks_fit` before anything is written. The
latest sizing record (`tunelab size`) holds the budget it measured against
(`memory_budget_bytes`), the worst micro-batch of the run's seeded order
(`worst_batch_peak`) and the evaluation's largest batch (`evaluation_peak`), each for the
settings it was found at. Where the run's settings are those, the recorded figure is used
(measured, else predicted); where they changed since (another micro-batch, seed, step count or
snapshot; other evaluation settings), the peak is predicted again from the sizing's model
facts, scaled by the ratio its own measurement showed (never below 1). A peak over the budget
refuses the run, naming the peak, the budget and the settings that lower it. Without a sizing
record, or one made before these peaks were recorded, nothing is checked.
"""

from __future__ import annotations

from typing import Any

from tunelab.core.errors import RunError
from tunelab.core.evidence import latest
from tunelab.core.record_sizing import (
    WRITING,
    SizingLengths,
    SizingPeak,
    SizingWorstBatch,
    peak_of,
    recommendation_of,
)
from tunelab.core.record_types import Sizing
from tunelab.core.study import Study
from tunelab.stages.sizing.memory import estimate_memory
from tunelab.stages.sizing.peaks import (
    evaluation_increase,
    evaluation_settings,
    find_worst_batch,
    worst_case,
    worst_settings,
)
from tunelab.stages.sizing.terms import Case, ModelFacts

FIXES = {
    "worst batch": "lower training.micro_batch_size (and raise training.grad_accum_steps to keep "
    "the effective batch), turn on training.activation_checkpointing",
    "evaluation": "lower evaluation.batch_size or evaluation.max_new_tokens",
}


def _worst_total(
    study: Study, sizing: Sizing, peak: SizingPeak, snapshot: Any
) -> tuple[int | None, str]:
    """(whole-process bytes of the run's worst batch, where the figure comes from)."""
    from tunelab.stages.sizing.lengths import representative_lengths
    from tunelab.stages.train.precision import resolve_precision
    from tunelab.stages.train.schedule import total_steps

    cfg = study.config
    counts = snapshot.manifest.get("counts", {}).get("final", {})
    steps = total_steps(cfg, int(counts.get("train") or 1))
    if peak.settings == worst_settings(cfg, steps, snapshot.id):
        return peak.total, f"sizing {sizing.id}"
    lengths = SizingLengths.of(WRITING, representative_lengths(study), "lengths")
    facts = ModelFacts.from_dict(sizing.facts or {})
    t = cfg.training
    order = lengths.order or []
    worst = find_worst_batch(order, t, facts.architecture, total_steps(cfg, len(order)))
    template = Case(
        seq_len=1, micro_batch=1, precision=resolve_precision(t.precision, sizing.device),
        checkpointing=t.activation_checkpointing, packing=t.packing,
        loss_fraction=float(lengths.loss_fraction or 1.0), optimizer=t.optimizer,
        device=sizing.device,
    )  # fmt: skip
    est = estimate_memory(facts, worst_case(template, worst))
    cuda = sizing.device == "cuda"
    step = (est.peak_total if cuda else est.peak_increase) * peak.scale
    idle = 0 if cuda else peak.idle_rss
    step_of = SizingWorstBatch.of(WRITING, worst, "worst_batch_peak.batch").step
    where = f"predicted for step {step_of} from sizing {sizing.id}'s model facts"
    return int(idle + step), where


def _evaluation_total(
    study: Study, sizing: Sizing, peak: SizingPeak, snapshot: Any
) -> tuple[int | None, str]:
    """(bytes of `tunelab eval`'s largest batch, where the figure comes from)."""
    cfg = study.config
    facts = ModelFacts.from_dict(sizing.facts or {})
    recorded = peak.settings or {}
    known = peak.evaluation_settings
    settings = evaluation_settings(cfg, facts.architecture, int((known and known.tokens) or 1))
    if settings == recorded:
        return peak.total, f"sizing {sizing.id}"
    precision = recommendation_of(sizing).precision or "fp32"
    added = evaluation_increase(facts, settings, precision)
    if added is None:
        return None, "not modelled"
    cuda = sizing.device == "cuda"
    idle = facts.total_weight_bytes if cuda else peak.idle
    where = f"predicted at the study's evaluation settings from sizing {sizing.id}"
    return int(idle + added["increase"] * peak.scale), where


def require_peaks_fit(study: Study, snapshot: Any, command: str = "train") -> None:
    """Refuse (RunError, exit 2) a run on `snapshot` whose worst batch or evaluation is over
    the budget of the latest sizing record; nothing is written either way."""
    found = latest(study, "sizing")
    if found is None:
        return
    sizing = Sizing.read(found.path)
    budget = sizing.memory_budget_bytes
    if not budget:
        return
    over = []
    for name, peak, total_of in (
        ("worst batch", peak_of(sizing, "worst_batch_peak"), _worst_total),
        ("evaluation", peak_of(sizing, "evaluation_peak"), _evaluation_total),
    ):
        if peak is None:
            continue
        total, where = total_of(study, sizing, peak, snapshot)
        failed = peak.status == "does_not_fit" and where == f"sizing {sizing.id}"
        if failed or (total is not None and total > budget):
            size = f"{total / 2**20:,.0f} MiB" if total else "more than the budget"
            over.append((name, f"the {name}'s peak {size} ({where})"))
    if over:
        names = " and ".join(text for _, text in over)
        fixes = "; ".join(FIXES[name] for name, _ in over)
        raise RunError(
            f"{command} refused before step 1: {names} over the memory budget of "
            f"{budget / 2**20:,.0f} MiB recorded by sizing {sizing.id}",
            hint=f"{fixes}; or raise the budget (`tunelab size --memory-budget`), then "
            "`tunelab size` again",
        )
