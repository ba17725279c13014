"""validate, runs, env: the study config, every attempt, the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunelab.cli.common import JsonOpt, SetOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.core.config import config_warnings
from tunelab.core.env import capture_env
from tunelab.core.record_parts import RunEnv
from tunelab.stages.hypothesis.pins import drift
from tunelab.stages.hypothesis.validate import validate_study


@app.command()
def validate(
    study: StudyDir = Path("."),
    sets: SetOpt = None,
    json_out: JsonOpt = False,
    strategy: Annotated[
        str | None, typer.Option(help="Also check the study trains under ddp or fsdp.")
    ] = None,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Processes per node.")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes, with --strategy.")] = 1,
    gpu: Annotated[
        str | None, typer.Option(help="With --nproc/--strategy: check the load on this GPU.")
    ] = None,
    memory_budget: Annotated[
        str | None, typer.Option(help="With --nproc/--strategy: a GPU's memory, e.g. 80GB.")
    ] = None,
) -> None:
    """Check study.yaml (and that the data it names exists, with the columns it maps) and
    report every problem at once; with --strategy / --nproc, also that layout (and, with --gpu
    or --memory-budget, that it loads)."""
    from tunelab.lib.tasks import task_warnings

    cfg = validate_study(study, sets or [])
    if strategy or nproc:
        from tunelab.stages.train.launch import Launch

        Launch(nproc or 1, strategy or "single", nnodes).check(cfg, rendezvous=False)
    if gpu or memory_budget:
        from tunelab.stages.hypothesis.validate import check_layout_load
        from tunelab.stages.sizing.recommend import parse_bytes

        budget = parse_bytes(memory_budget) if memory_budget else None
        check_layout_load(study, cfg, strategy=strategy or "single", nproc=nproc or 1, gpu=gpu,
                          device_bytes=budget)  # fmt: skip
    from tunelab.stages.train.precision import refused_here

    here = refused_here(cfg.training.precision)
    warnings = config_warnings(cfg) + task_warnings(cfg.task) + ([here] if here else [])
    notes = drift(study, cfg) if cfg.hub_refs() else []
    if json_out:
        emit_json(
            {
                "valid": True,
                "config_sha256": cfg.sha256(),
                "warnings": warnings,
                "config": cfg.to_dict(),
                "notes": notes,
            }
        )
        return
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    console.print(f"[green]valid[/] {study / 'study.yaml'}  config sha256 {cfg.sha256()[:12]}")
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    _print_snapshot_power(study, sets or [])


def _print_snapshot_power(study: Path, sets: list[str]) -> None:
    """Once a data snapshot exists: what its validation split can detect."""
    from tunelab.cli.hypothesis import print_power
    from tunelab.stages.data.snapshot import list_snapshots
    from tunelab.stages.hypothesis.power import registration_power

    s = open_study(study, sets)
    if list_snapshots(s):
        print_power(registration_power(s, s.config))


@app.command()
def runs(
    study: StudyDir = Path("."),
    kind: Annotated[
        str | None, typer.Option(help="Only runs of this kind (train, baseline, ...).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """List every attempt, including failed, invalid and interrupted ones, with reasons."""
    s = open_study(study, None)
    rows = s.list_runs(kind)
    if json_out:
        emit_json([r.to_dict() for r in rows])
        return
    colour = {
        "completed": "green",
        "running": "cyan",
        "failed": "red",
        "invalid": "red",
        "interrupted": "yellow",
    }
    # ids are never cut: the id (its parent's below it) has a column of its own; the creation
    # time is in the id, the reasons follow the table in full
    t = table(f"runs of {s.config.name}", [], [])
    t.add_column("id (parent)", no_wrap=True, min_width=max((len(r.id) for r in rows), default=2))
    for name in ("kind", "name", "status"):
        t.add_column(name, overflow="fold")
    for r in rows:
        t.add_row(
            r.id + (f"\n[dim]from {r.parent}[/]" if r.parent else ""),
            r.kind,
            r.name or "",
            f"[{colour.get(r.status, 'white')}]{r.status}[/]",
        )
    console.print(t)
    for r in rows:
        if r.reason:
            console.print(f"{r.id} {r.status}: {r.reason}", highlight=False)
    if not rows:
        console.print("no runs yet")


@app.command()
def env(
    json_out: JsonOpt = False,
    check: Annotated[
        bool,
        typer.Option("--check", help="Check the study's model, method and extensions here."),
    ] = False,
    study: StudyDir = Path("."),
) -> None:
    """The environment: Python, OS, CPU, torch, CUDA/ROCm, GPUs, attention kernels, packages;
    --check: whether the study's model, method, precision and extensions work here (exit 2)."""
    e = capture_env()
    if check:
        _env_check(e, study, json_out)
        return
    if json_out:
        emit_json(e)
        return
    env = RunEnv.of("environment", e)
    git = env.git_commit
    rows = [
        ["python", env.python],
        ["os", (env.os or {}).get("platform")],
        ["cpu", env.cpu_text],
        ["torch", env.torch],
        ["backend", env.backend],
        ["cuda", env.cuda],
        ["rocm", env.rocm],
        ["cudnn", env.cudnn],
        ["nccl", env.nccl],
        ["driver", env.driver],
        [
            "gpus",
            ", ".join(f"{g.name} {(g.memory_bytes or 0) / 2**30:.0f} GiB" for g in env.devices)
            or "none",
        ],
        ["bf16", env.bf16_supported],
        ["attention", ", ".join(k for k, v in (env.attention or {}).items() if v)],
        *[[k, v] for k, v in (env.packages or {}).items()],
        ["git", git and git[:12]],
    ]
    console.print(table("environment", ["what", "value"], rows))


def _env_check(e: dict, study: Path, json_out: bool) -> None:
    """`tunelab env --check`: the study's model, method, precision and extensions on this
    machine, each PASS, FAIL or N-A; exit 2 when one the study needs fails."""
    from tunelab.stages.smoke.backend import FAIL, backend_checks

    checks = backend_checks(open_study(study, None))
    if json_out:
        emit_json({"backend": e["backend"], "checks": [c.as_dict() for c in checks]})
    else:
        colour = {"PASS": "green", "FAIL": "red", "N-A": "dim"}
        rows = [
            [
                c.check,
                f"[{colour[c.result]}]{c.result}[/]",
                c.detail + (" (not used here)" if c.result == FAIL and not c.needed else ""),
            ]
            for c in checks
        ]
        console.print(table(f"the study on {e['backend']}", ["check", "result", "why"], rows))
    if any(c.result == FAIL and c.needed for c in checks):
        raise typer.Exit(2)
