"""plan: a rental plan from the measured figures; --review sets it against the ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import JsonOpt, SetOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.core.errors import ConfigError
from tunelab.core.record_base import Record
from tunelab.core.record_plan import (
    GpuComparison,
    GpuLayout,
    PlanFigure,
    PlanLoad,
    PlanProjection,
    PlanReview,
    PlanSchedule,
    ProjectionInput,
)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _h(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


@app.command()
def plan(
    study: StudyDir = Path("."),
    days: Annotated[
        int | None,
        typer.Option(help="Rental length: 3, 7 or 30 days (default budget.rental_days)."),
    ] = None,
    gpu_hour_price: Annotated[
        float | None,
        typer.Option(
            help="Price per GPU hour (default budget.gpu_hour_price; with --gpu, the catalog's)."
        ),
    ] = None,
    speedup: Annotated[
        float, typer.Option(help="How many times faster the rented device computes than this one.")
    ] = 1.0,
    step_time_s: Annotated[
        float | None, typer.Option(help="Optimizer step time on the rented device, if known.")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="Project the plan onto this catalog GPU (e.g. H100-SXM, L40S, MI300X)."),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(help="GPUs of that kind (with --gpu; --compare-gpus tries 1, 2, 4, 8)."),
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option(help="ddp | fsdp, for more than one GPU (--gpu: ddp; --compare-gpus: both)."),
    ] = None,
    utilization: Annotated[
        float | None,
        typer.Option(
            help="Share of the GPU's matrix peak a step reaches (default: the catalog's)."
        ),
    ] = None,
    compare_gpus: Annotated[
        bool,
        typer.Option("--compare-gpus", help="Every catalog GPU for this study, cheapest first."),
    ] = False,
    review: Annotated[
        bool, typer.Option("--review", help="Planned against actual durations from the ledger.")
    ] = False,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """A rental plan by phase from the measured step, evaluation and checkpoint times (or, with
    --gpu, projected onto a catalog GPU from the study's shapes): margins, cost, how many
    variants fit, and a Gantt chart (records/plans/<id>.png)."""
    from tunelab.stages.plan import stage as plan_stage
    from tunelab.stages.plan.review import plan_review

    s = open_study(study, sets)
    if review:
        _refuse_with_review(
            days=days, gpu_hour_price=gpu_hour_price, speedup=speedup if speedup != 1.0 else None,
            step_time_s=step_time_s, gpu=gpu, gpus=gpus, strategy=strategy,
            utilization=utilization, compare_gpus=compare_gpus or None,
        )  # fmt: skip
        _show(plan_review(s), json_out, print_review)
        return
    if compare_gpus:
        from tunelab.stages.plan.stage import compare_gpus as compare

        result = compare(s, days=days, gpus=gpus, strategy=strategy, utilization=utilization)
        _show(result, json_out, print_comparison)
        return
    record, path, png = plan_stage.run(
        s, days=days, gpu_hour_price=gpu_hour_price, speedup=speedup, step_time_s=step_time_s,
        gpu=gpu, gpus=gpus or 1, strategy=strategy or "ddp", utilization=utilization,
    )  # fmt: skip
    if json_out:
        emit_json({**record, "path": str(path), "chart_path": str(png)})
        return
    print_plan(PlanSchedule.of(path, record))
    console.print(f"record: {path}\nchart:  {png}")


def _refuse_with_review(**given: Any) -> None:
    """`--review` reads the latest plan: a flag that makes a plan (one not None) would be
    ignored."""
    flags = ["--" + name.replace("_", "-") for name, value in given.items() if value is not None]
    if flags:
        raise ConfigError(
            f"--review sets the latest plan against the runs: {', '.join(flags)} would be ignored",
            hint="make the plan with them first (`tunelab plan " + " ".join(flags) + " ...`), "
            "then `tunelab plan --review`",
        )


def _show(result: Record, json_out: bool, printer: Any) -> None:
    """`result` as JSON (as the stage built it), or printed by `printer`."""
    if json_out:
        emit_json(result.raw)
    else:
        printer(result)


def print_review(review: PlanReview) -> None:
    """The review table (what ran under each phase's name), its largest errors with the sign
    the table prints, the phases far off either way, and whether the margins held."""
    from tunelab.stages.plan.review import RESOLUTION_S, far_off_remark, repeat_verdict

    reviewed = review.rows
    rows = [
        [
            f"{r.phase}\n[dim]{r.what}[/]",
            _h(r.planned_s),
            _h(r.actual_s),
            _pct(r.error_pct) + ("*" if r.below_resolution else ""),
            _h(r.planned_at_run_speed_s),
            _pct(r.error_at_run_speed_pct),
        ]
        for r in reviewed
    ]
    console.print(
        table(
            f"plan {review.plan}: planned vs actual (the units that ran)",
            ["phase (what ran)", "planned", "actual", "error", "at run speed", "error"],
            rows,
        )
    )
    console.print(
        "error: (planned - actual) / actual, + when the plan is longer than the runs; at run "
        "speed: the plan redone at the runs' own measured step and evaluation speed"
    )
    largest, at_speed = review.largest_error, review.largest_error_at_run_speed
    if largest is not None:
        line = f"largest phase error: {largest.phase} {_pct(largest.error_pct)}"
        if at_speed is not None:
            line += f"; at the runs' own speed: {at_speed.phase} {_pct(at_speed.error_pct)}"
        if any(r.below_resolution for r in reviewed):
            line += f" (* under {RESOLUTION_S:g} s both planned and actual: shown, not counted)"
        console.print(line)
    for r in reviewed:
        if (verdict := repeat_verdict(r)) is not None:
            console.print(verdict)
    far = [r.phase for r in reviewed if r.far_off]
    for r in reviewed:
        if (remark := far_off_remark(r)) is not None:
            console.print(f"[yellow]far off:[/] {remark}")
    for note in review.notes or []:
        console.print(f"[yellow]note:[/] {note}")
    over = [
        f"{r.phase} took {100 * ((r.actual_s or 0) / r.planned_s - 1):.1f}% more than "
        f"planned (margin {r.margin_pct}%)"
        for r in reviewed
        if r.within_margin is False and not r.below_resolution
    ]
    if over:
        console.print("; ".join(over))
    elif far:
        console.print(
            f"the plan's margins absorbed every measured phase, but {' and '.join(far)} "
            f"{'is' if len(far) == 1 else 'are'} far off (above)"
        )
    elif any(r.within_margin is not None for r in reviewed):
        console.print("the plan's margins absorbed every measured phase")


# what each figure printed under a plan is, in words (its value is in seconds)
FIGURE_WORDS = {
    "step_s": "an optimizer step",
    "eval_s_per_example": "an evaluated example (the baseline's)",
    "checkpoint_save_s": "a checkpoint save",
    "reload_s": "a checkpoint loaded in a new process",
}


def _figure_line(key: str, fig: PlanFigure | None) -> str:
    value, source = (fig.value, fig.source or "") if fig is not None else (None, "")
    if value is None:
        return f"  {key}: -  ({source})"
    if key == "answer_length_s_per_example":
        way = "shorter" if value < 0 else "longer"
        meaning = (
            f"{value:+.4g} s an example: the answers are {way} than what the baseline generated"
            if value
            else "0 s an example: the answers are as long as what the baseline generated"
        )
    elif key == "adapted_extra_s_per_example":
        meaning = f"+{value:.4g} s an example for the adapter's unmerged layers"
    else:
        meaning = f"{value:.4g} s {FIGURE_WORDS.get(key, '')}".rstrip()
    return f"  {key}: {meaning}  ({source})"


def print_plan(plan: PlanSchedule) -> None:
    """The plan `tunelab plan` recorded."""
    v = plan.variant
    rows = [
        [p.phase, _h(p.start_s), _h(p.planned_s), f"+{p.margin_pct}%", _h(p.total_s)]
        for p in plan.phases
    ]
    console.print(
        table(
            f"{plan.days}-day plan on {plan.device or plan.gpu} ({plan.num_variants} variants)",
            ["phase", "starts at", "planned", "margin", "with margin"],
            rows,
        )
    )
    console.print(
        f"one variant: {v.steps} steps x {plan.step_time_s:.3f} s + "
        f"{v.validation_passes} validation passes + {v.checkpoint_saves} checkpoint saves "
        f"+ {_h(v.startup_s)} start = {_h(v.total_s)}"
    )
    c, projection = plan.cost, plan.projection
    money = projection.currency if projection is not None else None
    unit = f" {money}" if money else ""
    console.print(
        f"busy {_h(plan.busy_s)} of a {(plan.window_s or 0) / 3600:.0f} h window; "
        f"{plan.variants_that_fit} variants fit; cost {c.busy_cost or 0:,.2f}{unit} busy, "
        f"{c.rental_cost or 0:,.2f}{unit} for the whole rental ({c.rental_hours} h x "
        f"{plan.gpu_hour_price:g})"
    )
    console.print(f"one evaluation of a variant: {_h(plan.evaluation_run_s)}")
    # a variant's evaluation beside the baseline's: printed when the plan has them
    variant_keys = ("answer_length_s_per_example", "adapted_extra_s_per_example")
    for key in ("step_s", "eval_s_per_example", "checkpoint_save_s", "reload_s", *variant_keys):
        fig = plan.input_figure(key)
        if key in variant_keys and fig is None:
            continue
        console.print(_figure_line(key, fig), style="dim")
    if projection is not None:
        print_projection(projection)
    for w in plan.warnings or []:
        console.print(f"[yellow]warning:[/] {w}")


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def print_projection(p: PlanProjection) -> None:
    """How a GPU plan's step was projected, and which of its inputs were measured."""
    fit, step, u = p.fit, p.step, p.utilization
    layout = f"{fit.micro_batch} x {fit.grad_accum} accumulation" + (
        ", activation checkpointing" if fit.checkpointing else ""
    )
    console.print(
        f"on {p.gpus}x {p.gpu_name} ({p.strategy}, {p.precision}): micro-batch "
        f"{layout}; predicted peak {_gb(fit.peak_bytes)} of {_gb(fit.budget_bytes)}"
        + ("" if fit.fits else " (DOES NOT FIT)")
    )
    if fit.load is not None:
        console.print(load_line(fit.load))
    console.print(
        f"step {step.value:.4g} s ({step.low:.4g}-{step.high:.4g} s over a utilization "
        f"of {u.low:.2f}-{u.high:.2f}), {step.flops / 1e12:.3g} TFLOP, bound by the "
        f"{step.bound}; evaluation {p.eval_s_per_example:.3g} s an example"
    )
    print_inputs(p.inputs)
    console.print(
        f"  price: {p.price_per_gpu_hour:g}{' ' + p.currency if p.currency else ''}"
        " a GPU hour "
        f"({p.price_source})",
        style="dim",
    )


def load_line(load: PlanLoad) -> str:
    """The load-time peak (tunelab.stages.sizing.load) in one line: `plan --gpu` and `size`."""
    return (
        f"load ({load.mode}): {_gb(load.device_per_rank)} on each GPU; host "
        f"{_gb(load.host_per_rank)} a rank, {_gb(load.host_per_node)} the node "
        f"({load.why})"
    )


def print_load(rows: list[Any] | None, path: Path = Path("records/sizing")) -> None:
    """`tunelab size`: the load of one process and of each rank count under DDP and FSDP
    (`load_table`'s rows, as written in the sizing record at `path`) in one line, then each
    that cannot fit the budget."""
    if not rows:
        return
    loads = [r if isinstance(r, PlanLoad) else PlanLoad.of(path, r, f"load[{i}]")
             for i, r in enumerate(rows)]  # fmt: skip
    parts = [
        ("1 process" if r.ranks == 1 else f"{r.ranks} {r.strategy}")
        + f" {r.device_per_rank / 1e9:,.2f}/{r.host_per_node / 1e9:,.2f}"
        for r in loads
    ]
    console.print("load, GB a device / GB the node's host: " + "; ".join(parts), style="dim")
    for r in loads:
        if r.problem:
            way = "1 process" if r.ranks == 1 else f"{r.ranks} ranks {r.strategy}"
            console.print(f"{way}: {r.problem}")


def print_inputs(inputs: list[ProjectionInput]) -> None:
    """Each input of a projection: measured, read, datasheet, given or assumed, and its source."""
    for i in inputs:
        console.print(f"  {i.kind}: {i.name}: {i.value}  ({i.source})", style="dim")


def _layout(r: GpuLayout) -> str:
    return f"{r.gpus} {r.strategy}" if (r.gpus or 1) > 1 else "1"


def _why_not(r: GpuLayout) -> str:
    """A layout's reason, short: the load, the weights, the evaluation on one GPU, or the
    step's peak."""
    why = r.why_not or ""
    if r.others:  # a GPU's largest refusal: every strategy's reason, this one's last
        why = why.rsplit(f"{r.strategy}: ", 1)[-1]
    load = r.load
    if why.startswith("the load does not fit") and load is not None:
        return (
            f"load {load.device_per_rank / 1e9:.1f} GB a GPU over {r.memory_bytes / 1e9:.0f}"
            f" GB: weights {(load.weights or 0) / 1e9:.1f} GB, "
            + ("sharded" if load.mode == "sharded" else "whole on every GPU")
        )
    if why.startswith(("weights", "tunelab train refuses")):
        return why
    if why.startswith("the evaluation does not fit"):  # its figure, before the settings
        return "evaluation " + why.removeprefix("the evaluation does not fit: ").split(" (")[0]
    return f"peak {r.peak_bytes / 1e9:.1f} GB over {r.memory_bytes / 1e9:.0f} GB"


def print_comparison(result: GpuComparison) -> None:
    """One row per catalog GPU that fits, its best layout, the cheapest first (readable at 80
    columns); then why each GPU that fits no layout does not."""
    from rich import box

    days, money, best = result.days, result.currency, result.rows
    rows = []
    for r in (r for r in best if r.fits):
        micro = f"{r.micro_batch}x{r.grad_accum}" + ("c" if r.checkpointing else "")
        rows.append(
            [
                r.gpu,
                _layout(r),
                micro,
                f"{r.step_s:.3g}",
                f"{r.hours_per_variant:.3g}",
                f"{r.variants[days]:,}",  # variants that fit a rental of 3, 7 and 30 days
                f"{r.busy_cost:,.2f}",
                f"{r.rental_cost:,.0f}",
            ]
        )
    counts = "/".join(str(n) for n in result.gpus)
    at = f"{counts} GPU" + ("" if counts == "1" else "s")
    console.print(
        table(
            f"each GPU's best layout of {counts} GPUs a node that fits ("
            + (result.strategy or "ddp or fsdp")
            + f"), {result.num_variants} variants registered",
            [
                "GPU",
                "GPUs",
                "micro",
                "step s",
                "h/var",
                f"var/{days} d",
                f"busy {money}",
                f"{days} d {money}",
            ],
            rows,
            box=box.SIMPLE_HEAD,
            pad_edge=False,
        )
    )
    for r in best:
        if not r.fits:
            tried = [*r.others, r]
            why = "; ".join(
                (f"{t.strategy}: " if len(tried) > 1 else "") + _why_not(t) for t in tried
            )
            console.print(f"{r.gpu}: does not fit at {at} ({why})")
    _print_answer(result)
    console.print(
        "GPUs: GPUs a node and strategy; micro: micro-batch x accumulation per GPU (c: "
        "activation checkpointing); step s: an optimizer step at the default utilization; "
        f"h/var: hours a variant takes with its margins; var/{days} d: variants that fit the "
        f"rental; busy: the cost of the busy hours; {days} d: the whole rental (the catalog's "
        f"prices, in {money}, for all the layout's GPUs)"
    )
    for note in result.notes:
        console.print(f"note: {note}")
    shares = {
        f"{r.arch} {r.utilization:.2f}" + (" measured" if r.utilization_measured else "")
        for r in best
    }
    console.print(
        "utilization (share of the matrix peak): "
        + ", ".join(sorted(shares))
        + ("; set one with --utilization U" if result.utilization_given is None else "")
    )
    print_inputs(result.inputs)
    for gpu_id, source in result.sources.items():
        console.print(f"  {gpu_id}: {source}", style="dim")


def _print_answer(result: GpuComparison) -> None:
    answer = result.answer
    if answer.gpu is None:
        console.print(f"answer: none: {answer.why}", style="bold")
        return
    n = answer.gpus or 1
    layout = f" ({answer.strategy})" if n > 1 else ""
    row = next(
        r for r in result.layouts
        if (r.gpu, r.gpus, r.strategy) == (answer.gpu, n, answer.strategy)
    )  # fmt: skip
    experts = f"; {row.experts}" if row.experts else ""
    console.print(
        f"answer: {n}x {answer.gpu}{layout} for {answer.days} days, "
        f"{answer.rental_cost or 0:,.0f} {result.currency} for the rental, the cheapest that "
        f"holds the {result.num_variants} registered variants ({answer.busy_hours or 0:.2f} h "
        f"busy{experts})",
        style="bold",
    )
