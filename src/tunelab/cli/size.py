"""size: measured steps beside the analytic memory breakdown, and a recommendation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import JsonOpt, SetOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.cli.progress import ProgressBoard
from tunelab.errors import ConfigError
from tunelab.sizing.recommend import PRECISIONS, parse_bytes, parse_int_list, parse_precisions


def _mib(b: Any) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:+.1f}%"


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
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Measure full training steps (each configuration in its own process) against the analytic
    memory model; recommend micro-batch and accumulation within the memory budget."""
    from tunelab.sizing.stage import run_sizing

    precisions = parse_precisions(precision) if precision else None
    if allocator not in ("pinned", "default"):
        raise ConfigError(f"--allocator {allocator!r}: unknown", hint="pinned or default")
    s = open_study(study, sets)
    kwargs: dict[str, Any] = dict(
        seq_lens=parse_int_list(seq_len, "--seq-len") if seq_len else None,
        micro_batches=parse_int_list(micro_batch, "--micro-batch") if micro_batch else None,
        precisions=precisions,
        memory_budget=parse_bytes(memory_budget) if memory_budget else None,
        ranks=tuple(parse_int_list(ranks, "--ranks")),
        measure_steps=max(1, steps),
        allocator=allocator,
    )
    if json_out:
        record, path = run_sizing(s, **kwargs)
        emit_json({**record, "path": str(path)})
        return
    with ProgressBoard(transient=True) as board:

        def on_config(i: int, n: int, label: str) -> None:
            board.update("size", i, n, text=label)

        record, path = run_sizing(s, progress=on_config, **kwargs)
    print_sizing(record)
    console.print(f"record: {path}")


def print_sizing(record: dict[str, Any]) -> None:
    cuda = record["device"] == "cuda"
    lengths = record["lengths"]
    src = lengths.get("source")
    if lengths.get("p95") is not None:
        src += f" (p50 {lengths['p50']}, p95 {lengths['p95']}, max {lengths['max']} tokens)"
    console.print(f"lengths from {src}; device {record['device']}")
    rows, parts = [], []
    for r in record["configurations"]:
        o, p, m = r["options"], r["predicted"], r["measured"] or {}
        if r["status"] == "ok":
            measured = _mib(m.get("compared"))
        else:
            measured = "[red]does not fit[/]" if r["status"] == "does_not_fit" else r["status"]
        shape = f"{o['seq_len']}t {o['micro_batch']}x{o['grad_accum']} {o['precision']}"
        rows.append(
            [
                r["label"],
                shape + (" ckpt" if o["checkpointing"] else ""),
                _mib(p["compared"]),
                measured,
                _pct(r.get("error_pct")),
                _pct(r["rule_x4"]["error_pct"]),
                "-" if not m.get("projected_step_s") else f"{m['projected_step_s']:.2f}",
                "-" if not m.get("tokens_per_s") else f"{m['tokens_per_s']:,.0f}",
            ]
        )
        parts.append(
            [
                r["label"],
                _mib(p["weights"]),
                _mib(p["gradients"]),
                _mib(p["optimizer_states"]),
                _mib(p["activations"]),
                _mib(p["logits_loss"]),
                _mib(p["backward_temporaries"]),
                p["peak_phase"].replace("_", " "),
            ]
        )
    what = "peak allocated" if cuda else "RSS a step adds to the idle process"
    console.print(
        table(
            f"predicted vs measured ({what}, MiB)",
            ["configuration", "tokens, micro x accum", "predicted", "measured", "error"]
            + ["x4 rule", "step s", "tok/s"],
            rows,
        )
    )
    console.print(
        table(
            "analytic breakdown (MiB)",
            ["configuration", "weights", "grads", "optim", "activ", "logits", "temps", "peak at"],
            parts,
        )
    )
    console.print(
        f"max error {_pct(record['max_error_pct'])} (the weights x 4 rule: "
        f"{_pct(record['rule_x4_max_error_pct'])}); allocator: {record['allocator']}"
    )
    rec = record["recommendation"]
    budget = rec["budget_bytes"] / 2**30
    if rec.get("fits"):
        console.print(
            f"[green]recommended[/]: micro-batch {rec['micro_batch']} x accumulation "
            f"{rec['grad_accum']} (effective {rec['effective_batch']}), checkpointing "
            f"{'on' if rec['checkpointing'] else 'off'}, {rec['precision']}: predicted peak "
            f"{rec['predicted_peak_bytes'] / 2**30:.2f} GiB of {budget:.2f} GiB "
            f"({rec['margin']:.0%} margin kept)"
            + (f", {rec['tokens_per_s']:,.0f} tokens/s measured" if rec.get("tokens_per_s") else "")
        )
    else:
        console.print(f"[red]nothing fits[/] the budget of {budget:.2f} GiB: {rec['reason']}")
    if record["projection"]:
        console.print(
            table(
                "per-rank peak over N ranks, same effective batch (GiB)",
                ["ranks", "micro x accum", "DDP", "FSDP"],
                [
                    [
                        p["ranks"],
                        f"{p['micro_batch']}x{p['grad_accum']}",
                        f"{p['ddp'] / 2**30:.2f}",
                        f"{p['fsdp'] / 2**30:.2f}",
                    ]
                    for p in record["projection"]
                ],
            )
        )
