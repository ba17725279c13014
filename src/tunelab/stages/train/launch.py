"""`tunelab train --nproc N --strategy ddp|fsdp`: the same command again, once per rank, by torchrun.

The launcher builds one torchrun command line, runs it, waits, and then makes the run's status
tell the truth: torchrun starts, watches and stops the ranks (no process management of our own
beyond forwarding SIGTERM to it). One node:

    python -m torch.distributed.run --nproc_per_node N --standalone -m tunelab train ...

Several nodes: the same command on every node, with torchrun's `--nnodes M --node_rank R
--rdzv_backend static --rdzv_endpoint HOST:PORT` (static rendezvous: node 0 holds ranks
0..N-1, so rank 0, the one that writes records, is on node 0).

A rank that fails leaves `rank-<k>.json` in the launch folder (`TUNELAB_LAUNCH_DIR`); rank 0
leaves `run.json` naming the run. After torchrun exits the launcher copies the rank records into
the run's `ranks/` folder and, when torchrun failed, sets the status to failed naming each
failed rank ("rank 1: RuntimeError: ..."), unless the run was interrupted by a signal.

`Launch`, `run_torchrun`, `relaunch`, `rank_strategy`, `resume_launch`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.env import under_torchrun
from tunelab.core.errors import ConfigError, RunError
from tunelab.core.record_types import RunConfig, RunStatus
from tunelab.core.records import write_json_atomic
from tunelab.stages.train.launch_dir import (
    LAUNCH_DIR_ENV,
    announced_run,
    read_rank_records,
    report_rank_failure,
)
from tunelab.stages.train.parallel import (
    STRATEGIES,
    Distributed,
    make_strategy,
    strategy_problems,
)
from tunelab.stages.train.process_group import destroy_process_group
from tunelab.stages.train.rank_run import SINGLE, recorded_strategy
from tunelab.stages.train.shard_store import store_problems


@dataclass
class Launch:
    """What to start: processes per node, nodes, and where the nodes meet."""

    nproc: int = 1
    strategy: str = SINGLE
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def check(self, cfg: Any = None, rendezvous: bool = True) -> None:
        """Raise ConfigError on a contradiction between the options, or between the layout
        and the study's config `cfg` (when given); `rendezvous`: several nodes need
        --node-rank and --rdzv-endpoint (`validate --nnodes` checks the layout alone)."""
        problems = []
        if cfg is not None:
            problems = strategy_problems(cfg, self.strategy)
            problems += store_problems(cfg, self.strategy, self.nnodes)
        if problems:
            nodes = f" on {self.nnodes} nodes" if self.nnodes > 1 else ""
            raise ConfigError(
                f"--strategy {self.strategy}{nodes}: " + "; ".join(problems),
                hint="change the strategy or the study's config",
            )
        if self.strategy not in (SINGLE, *STRATEGIES):
            raise ConfigError(
                f"--strategy {self.strategy!r}: unknown",
                hint=f"use one of: {SINGLE}, {', '.join(STRATEGIES)}",
            )
        if self.nproc < 1 or self.nnodes < 1:
            raise ConfigError("--nproc and --nnodes must be at least 1", hint="e.g. --nproc 2")
        if self.strategy == SINGLE and self.world_size > 1:
            raise ConfigError(
                f"--nproc {self.nproc} --nnodes {self.nnodes} needs a distributed strategy",
                hint="add --strategy ddp (a replica per rank) or --strategy fsdp (sharded)",
            )
        if rendezvous and self.nnodes > 1 and (self.node_rank is None or not self.rdzv_endpoint):
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --node-rank and --rdzv-endpoint",
                hint="run the same command on every node with --node-rank 0..N-1 and "
                "--rdzv-endpoint HOST:PORT of node 0",
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}",
                hint="number the nodes from 0; node 0 holds rank 0 and writes the records",
            )

    @property
    def distributed(self) -> bool:
        return self.strategy != SINGLE


def torchrun_command(launch: Launch, command: list[str]) -> list[str]:
    """The torchrun command line that starts `tunelab COMMAND` on each rank of this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(launch.nproc)]
    if launch.nnodes > 1:
        cmd += [
            "--nnodes",
            str(launch.nnodes),
            "--node_rank",
            str(launch.node_rank),
            "--rdzv_backend",
            "static",
            "--rdzv_endpoint",
            str(launch.rdzv_endpoint),
        ]
    elif launch.rdzv_endpoint:
        cmd += ["--rdzv_backend", "static", "--rdzv_endpoint", launch.rdzv_endpoint]
    else:
        # a local rendezvous on a free port of this machine
        cmd += ["--standalone"]
    return [*cmd, "-m", "tunelab", *command]


def child_environment(launch: Launch, launch_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[LAUNCH_DIR_ENV] = str(launch_dir)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "OMP_NUM_THREADS" not in env:
        # torchrun would set 1 with a warning; share this node's cores between its ranks
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // launch.nproc))
    return env


@dataclass
class LaunchResult:
    returncode: int
    run_id: str | None
    run_dir: Path | None
    status: str | None
    rank_failures: list[dict[str, Any]] = field(default_factory=list)


def run_torchrun(launch: Launch, command: list[str], study_root: Path) -> LaunchResult:
    """Run `tunelab COMMAND` under torchrun and settle the run's status; returns the result.

    The study's ledger is opened only after torchrun exits, to record the failure of a rank.
    """
    launch.check()
    launch_dir = Path(tempfile.mkdtemp(prefix="tunelab-launch-"))
    cmd = torchrun_command(launch, command)
    proc = subprocess.Popen(cmd, env=child_environment(launch, launch_dir))
    previous = signal.getsignal(signal.SIGTERM)

    def forward(signum: int, frame: Any) -> None:
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                # the terminal sent SIGINT to torchrun too; wait for it to stop the ranks
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        return settle(study_root, launch_dir, rc, several_nodes=launch.nnodes > 1)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


# What a rank reports when another rank died under it: a consequence, not the cause.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "remote process exited",
    "broken pipe",
)


def root_causes(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failures that are not just a rank losing its peer (all of them if none is)."""
    causes = [f for f in failures if not _peer_gone(f)]
    return causes or failures


def failure_reason(failures: list[dict[str, Any]], returncode: int) -> str:
    """'rank 1: RuntimeError: ...; rank 0: ...' (root causes first), or the exit code when no
    rank left a record."""
    if failures:
        causes = root_causes(failures)
        ordered = causes + [f for f in failures if f not in causes]
        return "; ".join(f"rank {f['rank']}: {f['error']}" for f in ordered)[:2000]
    return (
        f"torchrun exited with code {returncode} and no rank recorded an error (a rank killed "
        "by a signal or out of memory; torchrun's report names it)"
    )


def _peer_gone(failure: dict[str, Any]) -> bool:
    return any(m in failure["error"].lower() for m in _PEER_GONE)


def settle(
    study_root: Path, launch_dir: Path, returncode: int, *, several_nodes: bool = False
) -> LaunchResult:
    """After torchrun: copy rank records into the run, and set a failed status when due.

    With several nodes, a node whose ranks only lost their peers (a rank of another node was
    killed or its node preempted) leaves the run `interrupted`, to be resumed: nothing on this
    node failed."""
    records = read_rank_records(launch_dir)
    failures = [r for r in records if r.get("kind", "failed") == "failed"]
    info = announced_run(launch_dir)
    if info is None:
        # Failed before rank 0 created the run (or before it told this node which run).
        return LaunchResult(returncode, None, None, None, failures)
    if info["run_dir"] is None:
        # A node without rank 0: the run's records are node 0's; this launcher writes nothing.
        status = "completed" if returncode == 0 else None
        return LaunchResult(returncode, info["run_id"], None, status, failures)
    run_dir = Path(info["run_dir"])
    for r in records:
        write_json_atomic(run_dir / "ranks" / f"rank-{r['rank']}.json", r, overwrite=True)
    status = RunStatus.read(run_dir / "status.json")
    current = status.status
    if returncode != 0 and current != "completed" and (current == "running" or failures):
        if several_nodes and failures and all(_peer_gone(f) for f in failures):
            current = _set_status(
                study_root, run_dir, info, "interrupted", status, failures, returncode
            )
        elif not (current == "interrupted" and not failures):
            current = _set_status(study_root, run_dir, info, "failed", status, failures, returncode)
    return LaunchResult(returncode, info["run_id"], run_dir, current, failures)


def _set_status(
    study_root: Path,
    run_dir: Path,
    info: dict[str, Any],
    new: str,
    status: RunStatus,
    failures: list[dict[str, Any]],
    returncode: int,
) -> str:
    """Set the run's status `new` (failed, or interrupted by another node) from the launcher."""
    from tunelab.core.study import Run, Study

    reason = failure_reason(failures, returncode)
    if new == "interrupted":
        reason = (
            "another node's rank stopped (killed or preempted); this node's ranks lost their "
            f"peers: {reason}"
        )[:2000]
    study = Study.open(study_root, RunConfig.read(run_dir / "config.json").overrides)
    Run(study, info["run_id"], run_dir).set_status(
        new,
        reason,
        error="RankFailure" if new == "failed" else "PeerLost",
        ranks=[{k: f.get(k) for k in ("rank", "host", "error")} for f in failures],
        torchrun_exit_code=returncode,
        previous_status=status.status,
        previous_reason=status.reason,
    )
    return new


def raise_for_result(result: LaunchResult) -> None:
    """Raise RunError when the launch failed (the CLI prints it, exit 2)."""
    if result.returncode == 0:
        return
    if result.run_id and result.run_dir is None:
        # a node without rank 0: the run's status is in node 0's records
        raise RunError(
            f"this node's ranks of run {result.run_id} stopped: "
            f"{failure_reason(root_causes(result.rank_failures), result.returncode)}",
            hint="node 0's records hold the run's status (`tunelab runs` there); the same "
            "command with --name NAME --resume-if-exists on every node resumes an interrupted run",
        )
    where = f"run {result.run_id} {result.status}" if result.run_id else "no run was created"
    if result.run_dir and result.status == "interrupted":
        reason = RunStatus.read(result.run_dir / "status.json").reason
        raise RunError(
            reason or where,
            hint=f"`tunelab resume {result.run_id}` continues from its latest checkpoint",
        )
    causes = root_causes(result.rank_failures)
    if result.run_dir and causes:
        hint = f"each failed rank's traceback is in {result.run_dir / 'ranks'}"
    else:
        hint = "the ranks' tracebacks and torchrun's report are printed above"
    raise RunError(
        f"distributed training failed ({where}): {failure_reason(causes, result.returncode)}",
        hint=hint,
    )


def recorded_launch(run_dir: Path) -> Launch:
    """The strategy and world size a run was started with (from its env.json)."""
    strategy, world_size = recorded_strategy(run_dir)
    return Launch(nproc=world_size, strategy=strategy)


# ------------------------------------------------------------------ what the CLI calls


def forward_options(**options: Any) -> list[str]:
    """Command-line options for the ranks: `name="x"` -> ["--name", "x"], `json=True` ->
    ["--json"], `set=["a=1", "b=2"]` -> ["--set", "a=1", "--set", "b=2"]; None and False are
    left out."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def relaunch(launch: Launch, study_root: Path, command: list[str]) -> bool:
    """With a distributed strategy outside torchrun: run `tunelab COMMAND --strategy S` on
    every rank through torchrun, settle the run's status, raise RunError if it failed, and
    return True. Return False where this process should do the work itself (single process,
    or already a rank started by torchrun)."""
    launch.check()
    if under_torchrun():
        if not launch.distributed and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"started by torchrun with {os.environ['WORLD_SIZE']} processes but with "
                "--strategy single: every rank would train its own copy",
                hint="add --strategy ddp or --strategy fsdp (or let `--nproc N` call torchrun)",
            )
        return False
    if not launch.distributed:
        return False
    result = run_torchrun(launch, [*command, "--strategy", launch.strategy], study_root)
    raise_for_result(result)
    return True


@contextlib.contextmanager
def rank_strategy(launch: Launch, precision: str) -> Iterator[Distributed | None]:
    """In a rank: join the process group as the launch's strategy (None for a single process);
    a failure leaves the rank's record for the launcher; the group is left at the end."""
    if not launch.distributed:
        yield None
        return
    with report_rank_failure():
        strategy = make_strategy(launch.strategy, precision)
        try:
            yield strategy
        finally:
            destroy_process_group()


def recorded_precision(run_dir: Path) -> str:
    """training.precision of a run as it was started (study.yaml plus its --set overrides)."""
    return RunConfig.read(run_dir / "config.json").training.precision


def on_another_node(node_rank: int | None) -> bool:
    """Whether this launcher (--node-rank) or rank (torchrun's GROUP_RANK) is on a node other
    than 0, whose study copy holds no run: node 0's records do."""
    if under_torchrun():
        return int(os.environ.get("GROUP_RANK", "0")) > 0
    return bool(node_rank)


def other_node_launch(
    strategy: str | None, nproc: int | None, nnodes: int, node_rank: int | None, rdzv: str | None
) -> Launch:
    """The launch of a resume on a node other than 0: its --strategy and --nproc as given (this
    copy has no record of them; rank 0 checks them against the run's checkpoint)."""
    if under_torchrun():
        nproc = nproc or 1  # the ranks already exist
    if strategy is None or nproc is None:
        raise RunError(
            "`tunelab resume` on a node other than 0 needs --strategy and --nproc: this node's "
            "copy of the study holds no run to read them from",
            hint="give the strategy and processes per node the run was started with (node 0's "
            "`tunelab runs` shows them), or use `tunelab train --name NAME --resume-if-exists` "
            "on every node",
        )
    return Launch(nproc, strategy, nnodes, node_rank, rdzv)


def resume_launch(
    run_dir: Path,
    *,
    strategy: str | None,
    nproc: int | None,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
) -> Launch:
    """The launch of a resumed run: the recorded strategy and world size unless given."""
    recorded = recorded_launch(run_dir)
    if under_torchrun():
        nproc = nproc or 1  # the ranks already exist; torchrun set the world size
    launch = Launch(
        nproc=nproc or max(1, recorded.world_size // nnodes),
        strategy=strategy or recorded.strategy,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
    )
    if not under_torchrun() and (launch.strategy, launch.world_size) != (
        recorded.strategy,
        recorded.world_size,
    ):
        raise RunError(
            f"run {run_dir.name} was trained with --strategy {recorded.strategy} on "
            f"{recorded.world_size} process(es), not {launch.strategy} on {launch.world_size}",
            hint=f"`tunelab resume {run_dir.name}` relaunches it as it was started; the global "
            "batch depends on the number of processes",
        )
    return launch
