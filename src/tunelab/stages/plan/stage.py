"""`tunelab plan`: gather the figures, build the plan, record it with its chart.

`run(study, ..., gpu=ID, gpus=N, strategy=, utilization=) -> (record, path, png)` (the
record's `projection` is absent for a plan of measured figures); `compare_gpus(study, days=,
gpus=, strategy=, utilization=) -> core.record_plan.GpuComparison` (`tunelab plan
--compare-gpus`) records nothing.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.core.errors import ConfigError
from tunelab.core.ledger import utc_now
from tunelab.core.record_plan import GpuComparison, GpuLayout, RentalAnswer, RentalOption
from tunelab.core.record_types import Sizing
from tunelab.core.records import write_json_atomic
from tunelab.core.study import Study
from tunelab.stages.plan.catalog import Gpu, currency, find_gpu
from tunelab.stages.plan.catalog import gpus as catalog_gpus
from tunelab.stages.plan.chart import draw_gantt
from tunelab.stages.plan.estimate import Plan, build_plan, variants_in_window
from tunelab.stages.plan.figures import Figures, gather_figures
from tunelab.stages.plan.project import (
    Projection,
    StudyShape,
    check_layout,
    experts_placement,
    measured_utilization,
    project,
)
from tunelab.stages.plan.rental import (
    gather_shape,
    local_figures,
    measured_run_utilization,
    projected_figures,
    sizing_configurations,
)
from tunelab.stages.plan.review import plan_review
from tunelab.stages.plan.stored import creation_ns, plans_dir


def run(
    study: Study,
    *,
    days: int | None = None,
    gpu_hour_price: float | None = None,
    speedup: float = 1.0,
    step_time_s: float | None = None,
    gpu: str | None = None,
    gpus: int = 1,
    strategy: str = "ddp",
    utilization: float | None = None,
) -> tuple[dict[str, Any], Path, Path]:
    """Gather the figures, build the plan, write records/plans/<id>.json and <id>.png.

    With `gpu` (a catalog id) the figures are projected onto `gpus` of that GPU (the record's
    `projection` says how); otherwise they are the measured ones, scaled by `speedup` or
    `step_time_s` when given. Returns (the record, its path, the chart's path). Raises
    ConfigError for a rental length other than 3, 7 or 30 days, a non-positive speed-up or step
    time, an unknown GPU, or a speed-up given with a GPU."""
    cfg = study.config
    days = check_days(cfg.budget.rental_days if days is None else days)
    check_price(gpu_hour_price)
    _check_speed(speedup, step_time_s, gpu)
    projection = None
    if gpu is None:
        check_gpu_only(gpus=gpus, strategy=strategy, utilization=utilization)
        figures = gather_figures(study)
        plan = build_plan(
            figures,
            cfg,
            days=days,
            gpu_hour_price=gpu_hour_price,
            speedup=speedup,
            step_time_s=step_time_s,
        )
    else:
        figures, plan, projection = gpu_plan(
            study,
            find_gpu(gpu),
            days=days,
            gpus=gpus,
            strategy=strategy,
            utilization=utilization,
            gpu_hour_price=gpu_hour_price,
        )
    return _record_plan(study, figures, plan, projection)


def _check_speed(speedup: float, step_time_s: float | None, gpu: str | None) -> None:
    """A speed-up and a step time are positive, and neither goes with a GPU (its step is
    projected from the study's shapes)."""
    for flag, value in (("--speedup", speedup), ("--step-time-s", step_time_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(
                f"{flag} {value:g}: --speedup and --step-time-s must be positive numbers",
                hint="e.g. --speedup 20 or --step-time-s 0.4",
            )
    if gpu is not None and (speedup != 1.0 or step_time_s is not None):
        raise ConfigError(
            "--gpu projects the step from the study's shapes: --speedup and --step-time-s "
            "do not apply",
            hint="drop --speedup / --step-time-s, or --utilization U to set the GPU's share",
        )


def _record_plan(
    study: Study, figures: Figures, plan: Plan, projection: dict[str, Any] | None
) -> tuple[dict[str, Any], Path, Path]:
    """records/plans/<id>.json with its chart <id>.png, set against what the ledger holds, and
    its ledger event: (the record, its path, the chart's path)."""
    plan_id = f"plan-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    folder = plans_dir(study)
    record = {
        "id": plan_id,
        "kind": "plan",
        "created_at": utc_now(),
        "created_ns": creation_ns(),
        "config_sha256": study.config.sha256(),
        "figures": figures.to_dict(),
        **plan.to_dict(),
        "chart": f"{plan_id}.png",
        "gantt_png": str(folder / f"{plan_id}.png"),
    }
    if projection is not None:
        record["projection"] = projection
    # what the ledger already holds, set against this plan (the report shows it)
    review = plan_review(study, record)
    record["review"] = review.raw
    actual = {r.phase: r.actual_s for r in review.rows}
    for written, ph in zip(record["phases"], plan.phases, strict=True):
        seconds = actual.get(ph.phase)
        written["name"] = ph.phase
        written["planned_h"] = round(ph.total_s / 3600, 4)
        written["actual_h"] = round(seconds / 3600, 4) if seconds else None
    png = draw_gantt(plan, folder / f"{plan_id}.png")
    path = write_json_atomic(folder / f"{plan_id}.json", record)
    study.ledger.add_event(
        None, "plan:recorded", {"id": plan_id, "fits": plan.fits, "busy_s": plan.busy_s}
    )
    return record, path, png


def check_price(price: float | None) -> None:
    """A price per GPU hour is a finite number, zero (hardware you own) or more."""
    if price is not None and not (math.isfinite(price) and price >= 0):
        raise ConfigError(
            f"--gpu-hour-price {price:g}: a price per GPU hour is a finite number, 0 or more",
            hint="e.g. --gpu-hour-price 2.5 (0 for hardware you own)",
        )


def check_gpu_only(*, gpus: int, strategy: str, utilization: float | None) -> None:
    """--gpus, --strategy and --utilization describe a catalog GPU: without --gpu (or
    --compare-gpus) the plan uses the measured figures and would ignore them."""
    given = [
        flag
        for flag, set_ in (
            (f"--gpus {gpus}", gpus != 1),
            (f"--strategy {strategy}", strategy != "ddp"),
            (f"--utilization {utilization}", utilization is not None),
        )
        if set_
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: only with --gpu ID or --compare-gpus (this plan uses the "
            "figures measured on this machine)",
            hint="add --gpu ID (e.g. --gpu H100-SXM), or --speedup X / --step-time-s S to scale "
            "the measured figures",
        )


def cheapest_rental(rows: list[RentalOption], num_variants: int, days: int) -> dict[str, Any]:
    """The rental that answers "which GPU, how many days, what cost": among the layouts the
    study fits, the shortest rental (3, 7 or 30 days) holding `num_variants` on each, then the
    cheapest of those. `{gpu, days, rental_cost, busy_hours}` (with the row's `gpus` and
    `strategy` when it has them), or `{gpu: None, why}`."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return {"gpu": None, "why": "the study fits no catalog GPU's memory"}
    options = []
    for r in fitting:
        shortest = next((d for d in (3, 7, 30) if r.variants[d] >= num_variants), None)
        if shortest is not None:
            # the rental costs its days x 24 h x the price: linear in the days
            cost = r.rental_cost * shortest / days
            options.append((cost, r.busy_hours, r.gpu, shortest, r))
    if not options:
        return {"gpu": None, "why": f"no catalog GPU runs {num_variants} variants within 30 days"}
    cost, busy, gpu, shortest, row = min(options, key=lambda o: o[:4])
    # a layout's GPUs and strategy, where it names them
    layout = {k: v for k, v in (("gpus", row.gpus), ("strategy", row.strategy)) if v is not None}
    return {"gpu": gpu, "days": shortest, "rental_cost": cost, "busy_hours": busy, **layout}


def check_days(days: int) -> int:
    if int(days) not in (3, 7, 30):
        raise ConfigError(f"--days {days}: plans are for 3, 7 or 30 days", hint="--days 3|7|30")
    return int(days)


def _projected_plan(
    shape: StudyShape,
    sizing: Sizing | None,
    local: Figures | None,
    cfg: Any,
    gpu: Gpu,
    *,
    days: int,
    gpus: int,
    strategy: str,
    utilization: float | None,
    gpu_hour_price: float | None,
    measured: tuple[float, Gpu, str] | None = None,
) -> tuple[Figures, Plan, Projection, float]:
    """The plan on `gpus` x `gpu`: (figures, plan, the projection, the price of a GPU hour)."""
    proj = project(
        shape,
        cfg,
        gpu,
        gpus=gpus,
        strategy=strategy,
        utilization=utilization,
        measured=measured or measured_utilization(sizing, shape),
    )
    figures = projected_figures(local, shape, proj, cfg, sizing_configurations(sizing))
    price = gpu.price_per_hour if gpu_hour_price is None else gpu_hour_price
    plan = build_plan(figures, cfg, days=days, gpu_hour_price=price * gpus)
    plan.gpu = f"{gpus}x {gpu.name}"
    plan.device = f"{plan.gpu} (projected)"
    plan.warnings = [*proj.notes, *plan.warnings]
    return figures, plan, proj, price


def gpu_plan(
    study: Study,
    gpu: Gpu,
    *,
    days: int,
    gpus: int = 1,
    strategy: str = "ddp",
    utilization: float | None = None,
    gpu_hour_price: float | None = None,
) -> tuple[Figures, Plan, dict[str, Any]]:
    """The plan of the study on `gpus` x `gpu`: (figures, plan, the projection's record)."""
    shape, sizing = gather_shape(study)
    figures, plan, proj, price = _projected_plan(
        shape,
        sizing,
        local_figures(study),
        study.config,
        gpu,
        days=days,
        gpus=gpus,
        strategy=strategy,
        utilization=utilization,
        gpu_hour_price=gpu_hour_price,
        measured=measured_run_utilization(study, shape),
    )
    projection = {
        **proj.to_dict(),
        "price_per_gpu_hour": price,
        "price_source": "--gpu-hour-price"
        if gpu_hour_price is not None
        else "the catalog's default",
        # the catalog's currency; a price given on the command line is in the user's own
        "currency": currency() if gpu_hour_price is None else None,
    }
    return figures, plan, projection


LAYOUT_GPUS = (1, 2, 4, 8)  # GPUs a node that `--compare-gpus` tries
# where a comparison's damage is named: `--compare-gpus` records nothing
COMPARED = Path("plan --compare-gpus")


def compare_gpus(
    study: Study,
    *,
    days: int | None = None,
    gpus: int | None = None,
    strategy: str | None = None,
    utilization: float | None = None,
) -> GpuComparison:
    """Every catalog GPU for the study, the cheapest that fits first. Each GPU is tried on
    `gpus` GPUs a node (default 1, 2, 4 and 8) under `strategy` (default: DDP and FSDP, the
    cheaper that fits), as a `GpuComparison` whose `raw` is `{answer, days, rows, layouts,
    inputs, notes, sources, currency}` (what `--json` prints): `rows`
    holds each GPU's best layout (its cheapest rental, else its largest layout, with why it does
    not fit), `layouts` every layout tried: `{gpu, name, gpus, strategy, fits, why_not,
    micro_batch, grad_accum, checkpointing, peak_bytes, memory_bytes, load, experts, step_s,
    step_low_s, step_high_s, bound, utilization, utilization_measured, hours_per_variant,
    variants {3, 7, 30}, busy_hours, busy_cost, rental_cost, price_per_gpu_hour}`. Nothing is
    recorded."""
    cfg = study.config
    days = check_days(cfg.budget.rental_days if days is None else days)
    t = cfg.training
    effective = t.micro_batch_size * t.grad_accum_steps
    # the effective batch divides among the GPUs (choose_fit refuses a --gpus that does not)
    counts = (gpus,) if gpus else tuple(n for n in LAYOUT_GPUS if effective % n == 0)
    for n in counts:
        check_layout(n, strategy or "ddp")
    shape, sizing = gather_shape(study)
    local = local_figures(study)
    measured = measured_run_utilization(study, shape)
    rows: list[GpuLayout] = []
    layouts: list[GpuLayout] = []
    inputs: list[dict[str, Any]] = []
    for gpu in catalog_gpus():
        tried = []
        for n in counts:
            for way in [strategy] if strategy else ["ddp", "fsdp"] if n > 1 else ["ddp"]:
                _, plan, proj, price = _projected_plan(
                    shape, sizing, local, cfg, gpu, days=days, gpus=n, strategy=way,
                    utilization=utilization, gpu_hour_price=None, measured=measured,
                )  # fmt: skip
                tried.append(_layout_row(gpu, plan, proj, price, cfg, shape))
                inputs = [asdict(i) for i in proj.inputs if i.name not in ("GPU", "utilization")]
        layouts += tried
        rows.append(_best_layout(tried, cfg.budget.num_variants, days))
    rows.sort(key=lambda r: (not r.fits, r.busy_cost))
    layouts.sort(key=lambda r: (not r.fits, r.busy_cost))
    return GpuComparison.of(COMPARED, {
        "answer": cheapest_rental(layouts, cfg.budget.num_variants, days),
        "days": days,
        "gpus": list(counts),
        "strategy": strategy,
        "num_variants": cfg.budget.num_variants,
        "utilization_given": utilization,
        "rows": [r.raw for r in rows],
        "layouts": [r.raw for r in layouts],
        "inputs": inputs,
        "notes": _layout_notes(shape, layouts)
        + [
            f"{n} GPUs not tried: the effective batch of {effective} examples "
            "(micro_batch_size x grad_accum_steps) does not divide among them"
            for n in LAYOUT_GPUS
            if not gpus and n not in counts
        ],
        "currency": currency(),
        "sources": {g.id: f"{g.source}: {g.url}" for g in catalog_gpus()},
    })  # fmt: skip


def _layout_row(
    gpu: Gpu, plan: Plan, proj: Projection, price: float, cfg: Any, shape: StudyShape
) -> GpuLayout:
    """One layout of `--compare-gpus`: the projection's fit and time, and the variants that fit
    in a rental of 3, 7 and 30 days (the same figures, another window)."""
    step, fit, n = proj.step, proj.fit, proj.gpus
    hours = float(cfg.budget.hours_per_day)
    per_variant = plan.per_variant_with_margins_s
    return GpuLayout.of(COMPARED, {
        "gpu": gpu.id,
        "name": gpu.name,
        "arch": gpu.arch,
        "gpus": n,
        "strategy": proj.strategy,
        "fits": fit.fits,
        "why_not": fit.reason,
        "micro_batch": fit.micro_batch,
        "grad_accum": fit.grad_accum,
        "checkpointing": fit.checkpointing,
        "peak_bytes": fit.peak_bytes,
        "memory_bytes": fit.budget_bytes,
        "load": fit.load,
        "experts": experts_placement(shape, n, proj.strategy),
        "step_s": step.value,
        "step_low_s": step.low,
        "step_high_s": step.high,
        "bound": step.bound,
        "utilization": proj.utilization.value,
        "utilization_measured": proj.utilization_measured,
        "hours_per_variant": plan.per_variant_with_margins_s / 3600,
        "variants": {
            d: variants_in_window(d * hours * 3600, plan.busy_s, plan.num_variants, per_variant)
            for d in (3, 7, 30)
        },
        "busy_hours": plan.cost.busy_hours,
        "busy_cost": plan.cost.busy_cost,
        "rental_cost": plan.cost.rental_cost,
        "price_per_gpu_hour": price,
    }, f"layouts.{gpu.id}.{n}.{proj.strategy}")  # fmt: skip


def _best_layout(tried: list[GpuLayout], num_variants: int, days: int) -> GpuLayout:
    """A GPU's layout for the table: the cheapest rental among those that fit, else the one
    that fits with the lowest busy cost, else the largest tried (its reason the most telling)."""
    fitting = [r for r in tried if r.fits]
    if not fitting:
        return tried[-1] if len(tried) < 2 else _largest_refusal(tried)
    pick = RentalAnswer.of(COMPARED, cheapest_rental(fitting, num_variants, days), "answer")
    if pick.gpu is not None:
        return next(r for r in fitting if (r.gpus, r.strategy) == (pick.gpus, pick.strategy))
    return min(fitting, key=lambda r: r.busy_cost)


def _largest_refusal(tried: list[GpuLayout]) -> GpuLayout:
    """The largest layout tried, its reason naming every strategy's at that size."""
    largest = max(r.gpus or 1 for r in tried)
    last = [r for r in tried if r.gpus == largest]
    if len(last) == 1:
        return last[0]
    why = "; ".join(f"{r.strategy}: {r.why_not}" for r in last)
    refusal = {**last[-1].raw, "why_not": why, "others": [r.raw for r in last[:-1]]}
    return GpuLayout.of(COMPARED, refusal, last[-1].where)


def _layout_notes(shape: StudyShape, layouts: list[GpuLayout]) -> list[str]:
    """What the table's layouts mean for this model (an MoE's experts under FSDP)."""
    moe = shape.facts.moe
    if not moe or not any(r.strategy == "fsdp" for r in layouts):
        return []
    return [
        f"mixture of experts: FSDP shards the experts' weights over the GPUs: transformers "
        f"keeps a layer's {moe['experts']} experts in one tensor and FSDP splits it on that "
        "dimension, so each GPU holds 1/N of them at rest; a layer's experts are gathered "
        "for its forward and backward, every GPU computing those its own tokens route to "
        "(sharded data parallel, not expert parallelism). "
        "DDP keeps every expert on every GPU."
    ]
