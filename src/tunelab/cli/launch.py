"""launch: write the SkyPilot task file or the Slurm batch script that trains a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunelab.cli.common import JsonOpt, StudyDir, app, console, console_err, emit_json, open_study


@app.command()
def launch(
    engine: Annotated[
        str, typer.Argument(help="skypilot (a task YAML) or slurm (an sbatch script).")
    ],
    name: Annotated[
        str,
        typer.Option(help="The run's name: every start of the job resumes the run of this name."),
    ],
    study: StudyDir = Path("."),
    gpu: Annotated[str | None, typer.Option(help="Catalog GPU id (default: the plan's).")] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="GPUs a node (default: the plan's --gpus).")
    ] = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes (default: the plan's, else 1).")] = None,
    strategy: Annotated[
        str | None, typer.Option(help="ddp or fsdp (default: the plan's; ddp for several ranks).")
    ] = None,
    cpu_ranks: Annotated[
        int | None, typer.Option(help="CPU ranks a node (gloo) instead of GPUs: CPU nodes, tests.")
    ] = None,
    time_limit_h: Annotated[
        float | None,
        typer.Option(help="Slurm time limit (default: the plan's days x hours a day)."),
    ] = None,
    port: Annotated[int, typer.Option(help="Rendezvous port on the first node.")] = 29500,
    disk_gb: Annotated[
        int | None, typer.Option(help="SkyPilot disk a node (default: from the base's size).")
    ] = None,
    spot: Annotated[bool, typer.Option("--spot", help="SkyPilot: spot instances.")] = False,
    bucket: Annotated[
        str | None,
        typer.Option(help="SkyPilot: the study folder in a bucket (s3://, gs://), mounted."),
    ] = None,
    partition: Annotated[str | None, typer.Option(help="Slurm partition.")] = None,
    account: Annotated[str | None, typer.Option(help="Slurm account.")] = None,
    install: Annotated[
        str | None, typer.Option(help="pip requirement for tunelab on the nodes (SkyPilot setup).")
    ] = None,
    why: Annotated[
        str | None,
        typer.Option(help="Go on where no smoke passed on the nodes' platform; recorded."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Where to write the file.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Write the file SkyPilot or Slurm runs to train the run NAME from the study's plan;
    run again after a preemption, a requeue or a kill, it resumes that run."""
    from tunelab.stages.launch import LaunchOptions
    from tunelab.stages.launch import run as write_launch

    s = open_study(study, None)
    options = LaunchOptions(
        name=name, gpu=gpu, gpus_per_node=gpus_per_node, nodes=nodes, strategy=strategy,
        cpu_ranks=cpu_ranks, time_limit_h=time_limit_h, port=port, disk_gb=disk_gb, spot=spot,
        bucket=bucket, partition=partition, account=account, install=install, why=why,
    )  # fmt: skip
    written = write_launch(s, engine, options, out)
    h = written.hand_off
    if json_out:
        emit_json({"path": str(written.path), "submit": written.submit, "engine": engine,
                   "plan": h.plan_id, "nodes": h.nodes, "nproc": h.nproc, "gpu": h.gpu,
                   "strategy": h.strategy, "warnings": h.warnings})  # fmt: skip
        return
    where = f"{h.gpus_per_node} x {h.gpu}" if not h.cpu else f"{h.nproc} CPU ranks"
    # paths whole, never wrapped: they are copied into commands
    console.print(f"wrote {written.path}", soft_wrap=True)
    console.print(f"{h.nodes} node(s), {where} a node, {h.strategy}, from plan {h.plan_id}")
    for w in h.warnings:
        console_err.print(f"[yellow]warning:[/] {w}")
    console.print(f"next: `{written.submit}`", soft_wrap=True)
