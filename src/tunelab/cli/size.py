"""size: measured steps beside the analytic memory breakdown, and a recommendation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box

from tunelab.cli.common import JsonOpt, SetOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.cli.plan import print_load
from tunelab.cli.progress import ProgressBoard
from tunelab.core.errors import ConfigError
from tunelab.core.record_sizing import (
    SizingPeak,
    SizingRecommendation,
    configurations_of,
    lengths_of,
    peak_of,
    projection_of,
    recommendation_of,
)
from tunelab.core.record_types import Sizing
from tunelab.stages.sizing.recommend import (
    PRECISIONS,
    parse_bytes,
    parse_int_list,
    parse_precisions,
)

METHODS = ("full", "lora", "qlora", "freeze")


def _mib(b: Any) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _images(sizing: Sizing) -> bool:
    """An image model's steps count images: its throughput is images a second."""
    return sizing.architecture == "image"


def _length_words(sizing: Sizing) -> tuple[str, str, str]:
    """(the unit of a measured length, its suffix in a shape, what the shape's length is):
    tokens, a ViT's patch tokens, or a conv net's image side in pixels."""
    unit = lengths_of(sizing).length_unit
    if unit == "image side":
        return "px a side", "px", "image side in pixels"
    if unit == "patch tokens":
        return "patch tokens", "t", "patch tokens"
    return "tokens", "t", "tokens"


@app.command()
def size(
    study: StudyDir = Path("."),
    seq_len: Annotated[
        str | None,
        typer.Option(help="Lengths to measure, e.g. 256,512 (default: p95 and max of the data)."),
    ] = None,
    micro_batch: Annotated[
        str | None, typer.Option(help="Micro-batch sizes to try besides the config's: 1,2,4,8.")
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(help=f"Precisions to try besides the config's: {','.join(PRECISIONS)}."),
    ] = None,
    memory_budget: Annotated[
        str | None, typer.Option(help="Memory budget, e.g. 80GB (default: the device's memory).")
    ] = None,
    ranks: Annotated[str, typer.Option(help="Rank counts for the DDP/FSDP projection.")] = "2,4,8",
    steps: Annotated[int, typer.Option(help="Measured optimizer steps after the warm-up.")] = 1,
    allocator: Annotated[
        str,
        typer.Option(help="CPU: 'pinned' (RSS follows the live tensors) or 'default' (glibc)."),
    ] = "pinned",
    methods: Annotated[
        str | None,
        typer.Option(help="Adaptation methods to measure besides the study's: full,lora,qlora."),
    ] = None,
    fresh_processes: Annotated[
        bool,
        typer.Option(
            "--fresh-processes",
            help="Measure each configuration in its own new process (default: all in one).",
        ),
    ] = False,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Measure full training steps (all configurations in one process, the model rebuilt for
    each) against the analytic memory model; recommend micro-batch and accumulation within the
    memory budget."""
    from tunelab.stages.sizing import stage as sizing_stage

    precisions = parse_precisions(precision) if precision else None
    if allocator not in ("pinned", "default"):
        raise ConfigError(f"--allocator {allocator!r}: unknown", hint="pinned or default")
    chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    unknown = [m for m in chosen or [] if m not in METHODS]
    if unknown:
        raise ConfigError(
            f"--methods {methods!r}: unknown {', '.join(unknown)}", hint=f"from {','.join(METHODS)}"
        )
    s = open_study(study, sets)
    kwargs: dict[str, Any] = dict(
        methods=chosen,
        seq_lens=parse_int_list(seq_len, "--seq-len") if seq_len else None,
        micro_batches=parse_int_list(micro_batch, "--micro-batch") if micro_batch else None,
        precisions=precisions,
        memory_budget=parse_bytes(memory_budget) if memory_budget else None,
        ranks=tuple(parse_int_list(ranks, "--ranks")),
        measure_steps=max(1, steps),
        allocator=allocator,
        shared=not fresh_processes,
    )
    if json_out:
        record, path = sizing_stage.run(s, **kwargs)
        emit_json({**record, "path": str(path)})
        return
    with ProgressBoard(transient=True) as board:
        record, path = sizing_stage.run(s, progress=board.update, **kwargs)
    print_sizing(record)
    console.print(f"record: {path}")


def _size(b: Any) -> str:
    """Bytes in the unit a reader compares at a glance: MiB under 1 GiB, else GiB."""
    if b is None:
        return "-"
    return f"{b / 2**20:,.1f} MiB" if abs(b) < 2**30 else f"{b / 2**30:,.2f} GiB"


def _compact(title: str, columns: list[str], rows: list[list[Any]], words: int = 1) -> Any:
    """A table that keeps 8 columns inside 80: no vertical rules, figures never wrapped, the
    first `words` columns (labels, shapes) wrapped or folded when they must."""
    t = table(title, columns, rows, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, c in enumerate(t.columns):
        if i < words:
            c.overflow = "fold"
        else:
            c.no_wrap = True
    return t


def _configurations(sizing: Sizing, cuda: bool) -> None:
    rows, parts = [], []
    _, suffix, length = _length_words(sizing)
    for r in configurations_of(sizing):
        o, p, m = r.options, r.prediction, r.measurement
        if r.status == "ok" and (m.compared or 0) <= 0:
            measured = "noise"  # the RSS did not grow: nothing to compare the prediction with
        elif r.status == "ok":
            measured = _mib(m.compared)
        else:
            measured = "[red]does not fit[/]" if r.status == "does_not_fit" else r.status
        shape = f"{o.seq_len}{suffix} {o.micro_batch}x{o.grad_accum} {o.precision}"
        rows.append(
            [
                r.label,
                shape + (" ckpt" if o.checkpointing else ""),
                _mib(p.compared),
                measured,
                "-" if measured == "noise" else _pct(r.error_pct),
                "-" if measured == "noise" else _pct(r.rule.error_pct),
                "-" if not m.projected_step_s else f"{m.projected_step_s:.2f}",
                "-" if not m.tokens_per_s else f"{m.tokens_per_s:,.0f}",
            ]
        )
        parts.append(
            [
                r.label,
                _mib(p.weights),
                _mib(p.gradients),
                _mib(p.optimizer_states),
                _mib(p.activations),
                _mib(p.logits_loss),
                _mib(p.backward_temporaries),
                (p.peak_phase or "").replace("_", " "),
            ]
        )
    rows += _peak_rows(sizing, suffix)
    what = "peak allocated" if cuda else "what a step adds to the idle process's RSS"
    console.print(
        _compact(
            f"predicted vs measured: {what} (MiB)",
            ["config", "shape", "predicted", "measured", "error"]
            + ["x4 rule", "step s", "img/s" if _images(sizing) else "tok/s"],
            rows,
            words=2,
        )
    )
    if cuda:
        compared = (
            "predicted: the analytic peak of the step's tensors; measured: "
            "torch.cuda.max_memory_allocated"
        )
    else:
        compared = (
            "predicted: the analytic increase of one step (optimizer states, gradients, "
            "activations, logits, temporaries); measured: peak RSS less the RSS of the idle "
            "process (model, optimizer and batch loaded); noise: the RSS did not grow"
        )
    console.print(
        f"shape: {length}, micro-batch x accumulation, precision; {compared}; x4 rule: the "
        "error of weights x 4."
    )
    _peak_legend(sizing)
    console.print(
        _compact(
            "analytic breakdown (MiB)",
            ["config", "weights", "grads", "optim", "activ", "logits", "temps", "peak at"],
            parts,
        )
    )


def _as_sizing(record: dict[str, Any]) -> Sizing:
    """The sizing record `tunelab size` wrote, read as its kind (`core.record_types.Sizing`)."""
    return Sizing.of(Path("records/sizing") / f"{record.get('id')}.json", record)


def _peak_legend(sizing: Sizing) -> None:
    """What the worst and eval rows of the table are."""
    worst, ev = peak_of(sizing, "worst_batch_peak"), peak_of(sizing, "evaluation_peak")
    if worst or ev:
        b = worst.worst_batch if worst else None
        step = f" (step {b.step} of {b.steps_scanned})" if b else ""
        batch = (
            "fwd: a forward of the classifier at its batch"
            if _images(sizing)
            else "rows of the longest prompt + new tokens generated, or fwd: a classifier's forward"
        )
        console.print(
            f"worst: the largest micro-batch the run meets in its seeded order{step}; eval: "
            f"`tunelab eval`'s largest batch ({batch}), over the model alone, no optimizer."
        )


def _peak_rows(sizing: Sizing, suffix: str) -> list[list[Any]]:
    """The worst batch of the run and the evaluation's batch, beside the typical steps."""
    rows: list[tuple[str, str, SizingPeak]] = []
    worst, ev = peak_of(sizing, "worst_batch_peak"), peak_of(sizing, "evaluation_peak")
    b = worst.worst_batch if worst is not None else None
    if worst is not None and b is not None:
        how = f"{b.tokens}{suffix} packed" if b.packed else ""
        how = how or f"{max(b.lengths)}{suffix} {len(b.lengths)}x1"
        rows.append(("worst", how, worst))
    st = ev.evaluation_settings if ev is not None else None
    if ev is not None and st is not None:
        shape = f"{st.tokens}{suffix} {st.batch_size}x"
        shape += f" +{st.max_new_tokens}" if st.kind == "generation" else " fwd"
        rows.append(("eval", shape, ev))
    out = []
    for label, shape, peak in rows:
        shown = _mib(peak.measured_compared) if peak.status == "ok" else "[red]does not fit[/]"
        if peak.status == "error":
            shown = "error"
        out.append(
            [label, shape, _mib(peak.predicted_compared), shown, _pct(peak.error_pct)]
            + ["-", "-", "-"]
        )
    return out


def _peaks_note(sizing: Sizing) -> None:
    """The whole-process peaks against the budget, and a peak that does not fit with its fix."""
    budget = sizing.memory_budget_bytes
    for key, name, fix in (
        ("worst_batch_peak", "the worst batch", "lower training.micro_batch_size"),
        (
            "evaluation_peak",
            "the evaluation",
            "lower evaluation.batch_size or evaluation.max_new_tokens",
        ),
    ):
        peak = peak_of(sizing, key)
        total = peak.total if peak is not None else None
        if peak is None or total is None:
            continue
        over = budget and (peak.status == "does_not_fit" or total > budget)
        words = f"{name}: {_size(total)} for the whole process, of a {_size(budget)} budget"
        if over:
            console.print(f"[red]{words}: does not fit[/]; {fix}, or raise --memory-budget")
        else:
            console.print(words)


def _recommendation(rec: SizingRecommendation, cuda: bool, rate: str) -> None:
    budget = _size(rec.budget_bytes)
    if not rec.fits:
        console.print(f"[red]nothing fits[/] the budget of {budget}: {rec.reason}")
        for other in rec.others:
            if other.fits:  # a method measured beside the study's (--methods)
                console.print(
                    f"  adaptation.method {other.method} fits: micro-batch "
                    f"{other.micro_batch} x {other.grad_accum}, checkpointing "
                    f"{'on' if other.checkpointing else 'off'}, predicted peak "
                    f"{_size(other.predicted_peak_bytes)}"
                )
        return
    measured = f", {rec.tokens_per_s:,.0f} {rate} measured" if rec.tokens_per_s else ""
    row = f' (row "{rec.row}")' if rec.row else ""
    console.print(
        f"[green]recommended[/]: micro-batch {rec.micro_batch} x accumulation "
        f"{rec.grad_accum} (effective {rec.effective_batch}), checkpointing "
        f"{'on' if rec.checkpointing else 'off'}, {rec.precision}{measured}{row}."
    )
    peak = _size(rec.predicted_peak_bytes)
    scale = rec.calibration or 1.0
    # the table compares a step's increase (CPU) or its tensors (CUDA); the budget holds all
    calibrated = (
        f" (x {scale:.2f}: the largest measured / predicted ratio above)" if scale > 1 else ""
    )
    margin = rec.margin or 0.0
    if rec.fixed_bytes is None:
        what = "peak allocated" if cuda else "peak RSS of the whole process"
        console.print(f"predicted {what}: {peak} of a {budget} budget")
    elif cuda:
        console.print(
            f"predicted peak allocated: {peak}, the analytic peak{calibrated}, of a {budget} budget "
            f"({margin:.0%} kept as margin)."
        )
    else:
        console.print(
            f"predicted peak RSS of the whole process: {peak} = the idle process "
            f"{_size(rec.fixed_bytes)} (largest measured) + {_size(rec.step_peak_bytes)} "
            f"a step adds{calibrated}, of a {budget} budget ({margin:.0%} kept as margin)."
        )


def print_sizing(record: dict[str, Any]) -> None:
    """The sizing `tunelab size` recorded, read as its kind (`core.record_types.Sizing`)."""
    sizing = _as_sizing(record)
    cuda = sizing.device == "cuda"
    lengths = lengths_of(sizing)
    src = lengths.source or ""
    if lengths.p95 is not None:
        unit = _length_words(sizing)[0]
        src += f" (p50 {lengths.p50}, p95 {lengths.p95}, max {lengths.max} {unit})"
    console.print(f"lengths from {src}; device {sizing.device}")
    _configurations(sizing, cuda)
    console.print(
        f"max error {_pct(sizing.max_error_pct)} (the weights x 4 rule: "
        f"{_pct(sizing.rule_x4_max_error_pct)}); allocator: {sizing.allocator}"
    )
    rate = "images/s" if _images(sizing) else "tokens/s"
    _recommendation(recommendation_of(sizing), cuda, rate)
    _peaks_note(sizing)
    projection = projection_of(sizing)
    if projection:
        console.print(
            _compact(
                "per-rank peak over N ranks, same effective batch",
                ["ranks", "micro x accum", "DDP", "FSDP"],
                [
                    [p.ranks, f"{p.micro_batch}x{p.grad_accum}", _size(p.ddp), _size(p.fsdp)]
                    for p in projection
                ],
            )
        )
        console.print(
            "DDP, FSDP: the analytic peak of one rank's tensors, without the process's own memory."
        )
    print_load(sizing.load)
