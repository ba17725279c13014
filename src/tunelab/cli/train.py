"""train, resume."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tunelab.cli.common import (
    JsonOpt,
    SetOpt,
    StudyDir,
    app,
    console,
    emit_json,
    fmt,
    open_study,
    rate_unit,
    table,
)
from tunelab.cli.progress import ProgressBoard
from tunelab.core.record_types import RunStatus
from tunelab.core.study import Run

if TYPE_CHECKING:
    from tunelab.core.study import Study
    from tunelab.stages.train.launch import Launch
    from tunelab.stages.train.parallel import Distributed

# Distributed training (tunelab.stages.train.launch): torchrun starts the same command once per rank.
StrategyOpt = Annotated[
    str | None,
    typer.Option(help="single, ddp (a replica per rank) or fsdp (sharded); with --nproc."),
]
NprocOpt = Annotated[
    int | None, typer.Option("--nproc", help="Processes (GPUs) on this node, through torchrun.")
]
NnodesOpt = Annotated[int, typer.Option("--nnodes", help="Nodes (torchrun --nnodes).")]
NodeRankOpt = Annotated[
    int | None, typer.Option("--node-rank", help="This node's rank; node 0 writes the records.")
]
OtherPlatformOpt = Annotated[
    bool,
    typer.Option(
        "--other-platform",
        help="Go on without a passing smoke and baseline on this platform; needs --why (recorded).",
    ),
]
ResumeIfExistsOpt = Annotated[
    bool,
    typer.Option(
        "--resume-if-exists",
        help="With --name: resume the interrupted run of that name (or report it if it "
        "completed) instead of refusing the name; the command to run again after a preemption.",
    ),
]
RdzvOpt = Annotated[
    str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0 (several nodes).")
]


def _summary(run: Run, status: RunStatus) -> dict[str, Any]:
    """The `--json` summary of a finished run."""
    return {"run_id": run.id, "status": status.status, "record": str(run.dir), **status.summary()}


def _print(run: Run, status: RunStatus, title: str, rate: str) -> None:
    rows = [
        ["run", run.id],
        ["status", status.status],
        ["steps", status.steps],
        ["final loss", fmt(status.final_loss)],
        ["val loss", f"{fmt(status.val_loss_initial)} -> {fmt(status.val_loss)}"],
        ["time", f"{fmt(status.train_seconds, 1)} s"],
        [rate, fmt(status.tokens_per_s, 0)],
        ["checkpoint", status.final_checkpoint],
        ["record", str(run.dir)],
    ]
    console.print(table(title, ["", ""], rows, show_header=False))
    console.print(f"next: `tunelab eval {run.id}`")


def _resume_launch(
    s: Study, run_id: str, elsewhere: bool, strategy: str | None, nproc: int | None,
    nnodes: int, node_rank: int | None, rdzv: str | None,
) -> tuple[Launch, str, str]:  # fmt: skip
    """(the launch, the run as the ranks name it, the precision they join with) of a resume:
    node 0 reads the run's record; another node's copy holds none, so it takes the options
    given and the study's precision, and its ranks take the run's own from node 0."""
    from tunelab.stages.train.launch import other_node_launch, recorded_precision, resume_launch

    if elsewhere:
        launch = other_node_launch(strategy, nproc, nnodes, node_rank, rdzv)
        return launch, run_id, s.config.training.precision
    stopped = s.get_run(run_id)
    launch = resume_launch(
        stopped.dir, strategy=strategy, nproc=nproc, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv,
    )  # fmt: skip
    return launch, stopped.id, recorded_precision(stopped.dir)


def _report(
    run: Run, ranks: Distributed | None, json_out: bool, title: str, action: str | None = None
) -> None:
    """The finished run's summary, as JSON or a table; only the main rank prints. `action`
    (started, resumed, completed) is added to the JSON of `train --resume-if-exists`."""
    if ranks is not None and not ranks.is_main:
        return
    status = run.last_status()
    if json_out:
        emit_json({**_summary(run, status), **({"action": action} if action else {})})
        return
    _print(run, status, title, rate_unit(run.study))


def _require_why(other_platform: bool, why: str | None) -> None:
    from tunelab.core.errors import RunError

    if other_platform and not (why and why.strip()):
        raise RunError(
            "--other-platform needs --why: the reason to go on without a smoke and a baseline "
            "on this platform is recorded with the run",
            hint='add --why "..." (e.g. --why "same torch build, smoke pending")',
        )


def _require_name(resume_if_exists: bool, name: str | None) -> None:
    from tunelab.core.errors import ConfigError

    if resume_if_exists and not name:
        raise ConfigError(
            "--resume-if-exists needs --name: the name is how a command run again finds its run",
            hint="add --name NAME (the same on every start of the job)",
        )


@app.command()
def train(
    study: StudyDir = Path("."),
    name: Annotated[str | None, typer.Option(help="A short name for the run.")] = None,
    parent: Annotated[
        str | None,
        typer.Option(help="The run this variant changes one thing of (id, prefix or name)."),
    ] = None,
    why: Annotated[str | None, typer.Option(help="What this run changes and why.")] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
    strategy: StrategyOpt = None,
    nproc: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvOpt = None,
    other_platform: OtherPlatformOpt = False,
    resume_if_exists: ResumeIfExistsOpt = False,
) -> None:
    """Train a run with a new id: progress bar, metrics.jsonl, atomic checkpoints."""
    from tunelab.stages.train import stage as train_stage
    from tunelab.stages.train.launch import (
        Launch,
        forward_options,
        rank_strategy,
        relaunch,
        under_torchrun,
    )
    from tunelab.stages.train.named import train_or_resume

    s = open_study(study, sets)
    _require_name(resume_if_exists, name)
    # rank 0 alone checks the name (the others start while it creates the run); the launcher of
    # a node other than 0 reads no record: node 0's hold the run
    first = not under_torchrun() or os.environ.get("RANK") == "0"
    if first and not node_rank:
        parent = s.check_new_run("train", None if resume_if_exists else name, parent)
    launch = Launch(nproc or 1, strategy or "single", nnodes, node_rank, rdzv_endpoint)
    launch.check(s.config)
    if first:  # the layout must load on this GPU (CUDA only)
        from tunelab.stages.hypothesis.validate import check_train_load

        check_train_load(s.root, s.config, launch)
    _require_why(other_platform, why)
    ranks_cmd = forward_options(
        study=s.root, name=name, parent=parent, why=why, set=sets, other_platform=other_platform,
        resume_if_exists=resume_if_exists,
    )  # fmt: skip
    if relaunch(launch, s.root, ["train", *ranks_cmd, *forward_options(json=json_out)]):
        return
    with (
        rank_strategy(launch, s.config.training.precision) as ranks,
        ProgressBoard(enabled=not json_out) as board,
    ):
        options = {"parent": parent, "why": why, "progress": board.update,
                   "platform_why": why if other_platform else None}  # fmt: skip
        if resume_if_exists:
            run, action = train_or_resume(s, name, strategy=ranks, **options)
        else:
            run, action = train_stage.run(s, name=name, strategy=ranks, **options), "started"
    titles = {"started": "training run", "resumed": "resumed run",
              "completed": "training run (completed before; nothing to do)"}  # fmt: skip
    _report(run, ranks, json_out, titles[action], action if resume_if_exists else None)


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="The stopped run (id, prefix or name).")],
    study: StudyDir = Path("."),
    json_out: JsonOpt = False,
    strategy: StrategyOpt = None,
    nproc: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvOpt = None,
    other_platform: OtherPlatformOpt = False,
    why: Annotated[str | None, typer.Option(help="Why --other-platform (recorded).")] = None,
) -> None:
    """Continue an interrupted run from its latest checkpoint, to the same result (a
    distributed run relaunches with its recorded --strategy and --nproc; on a node other than
    0, whose copy holds no record of the run, give them)."""
    from tunelab.stages.train import resume_run
    from tunelab.stages.train.launch import (
        forward_options,
        on_another_node,
        rank_strategy,
        relaunch,
    )

    s = open_study(study, None)
    elsewhere = on_another_node(node_rank)
    launch, run_ref, precision = _resume_launch(
        s, run_id, elsewhere, strategy, nproc, nnodes, node_rank, rdzv_endpoint
    )
    _require_why(other_platform, why)
    ranks_cmd = forward_options(study=s.root, json=json_out, other_platform=other_platform, why=why)
    if elsewhere:  # this node's ranks have no record to read the strategy from either
        ranks_cmd += forward_options(strategy=launch.strategy)
    if relaunch(launch, s.root, ["resume", run_ref, *ranks_cmd]):
        return
    with (
        rank_strategy(launch, precision) as ranks,
        ProgressBoard(enabled=not json_out) as board,
    ):
        progress = board.update
        run = resume_run(
            s,
            run_ref,
            progress=progress,
            strategy=ranks,
            platform_why=why if other_platform else None,
        )
    if not json_out and (ranks is None or ranks.is_main):
        for e in s.ledger.events(run.id):
            if e.kind == "checkpoint_skipped":
                console.print(f"note: skipped {e.detail}: no DONE marker (a save cut by a kill)")
    _report(run, ranks, json_out, "resumed run")
