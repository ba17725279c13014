"""The run as every rank of a distributed run holds it: rank 0 writes the records, the other
ranks follow it without touching its folder.

A follower's run points at its own study copy's folder for the run id (on several nodes without
a shared disk that folder does not exist there): it never reads or writes it, and learns what
it needs from rank 0.

`create_run`, `follow`, `follower`, `environment`, `FollowerRun`, `recorded_strategy(run_dir)` (the strategy
and world size a run was started with: resume relaunches with them, another one is refused).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tunelab.core.errors import RunError
from tunelab.core.run_parts import RunEnv
from tunelab.core.study import Run, Study
from tunelab.stages.train.launch_dir import announce_run
from tunelab.stages.train.strategy import SingleProcess, Strategy

SINGLE = "single"


class FollowerRun(Run):
    """The run as ranks other than 0 hold it: its id, in this node's study copy; statuses,
    heartbeats and every file of the run are rank 0's to write."""

    def set_status(self, status: str, reason: str | None = None, **extra: Any) -> None:
        pass

    def heartbeat(self) -> None:
        pass


def environment(strategy: Strategy | None) -> dict[str, Any]:
    """env.json of a run; a distributed run adds every rank's device and the backend with its
    version under `distributed`. A collective under a distributed strategy."""
    from tunelab.core.env import capture_env

    env = capture_env()
    described = (strategy or SingleProcess()).describe()
    if described is not None:
        env["distributed"] = {**env.get("distributed", {}), **described}
    return env


def create_run(strategy: Strategy | None, study: Study, kind: str, **kwargs: Any) -> Run:
    """`study.create_run(kind, **kwargs)` on rank 0; the other ranks get the same run as a
    FollowerRun of their own study copy (they write no record)."""
    strategy = strategy or SingleProcess()
    run = study.create_run(kind, **kwargs) if strategy.is_main else None
    run_id = strategy.broadcast_object(run.id if run else None)
    return _held(strategy, run) if run is not None else _held(strategy, follower(study, run_id))


def follower(study: Study, run_id: str) -> FollowerRun:
    """Run `run_id` as a rank other than 0 holds it: in this node's study copy."""
    return FollowerRun(study, run_id, study.runs_dir / run_id)


def _held(strategy: Strategy, run: Run) -> Run:
    """Tell this node's launcher which run its ranks train (rank 0: the run's folder; the first
    rank of another node: the run id alone, its records being node 0's)."""
    if strategy.is_main:
        announce_run(run.id, run.dir)
    elif os.environ.get("LOCAL_RANK") == "0":
        announce_run(run.id, None)
    return run


def recorded_strategy(run_dir: Path) -> tuple[str, int]:
    """The strategy and world size a run was started with (from its env.json)."""
    if not (run_dir / "env.json").exists():
        return SINGLE, 1
    d = RunEnv.read(run_dir / "env.json").parallel
    return d.strategy or SINGLE, d.world_size or 1


def follow(strategy: Strategy | None, run: Run) -> Run:
    """Before a resumed run goes on: the strategy and world size must be the recorded ones;
    every rank has finished its checks; ranks other than 0 get a FollowerRun."""
    strategy = strategy or SingleProcess()
    recorded, world_size = strategy.broadcast_object(
        recorded_strategy(run.dir) if strategy.is_main else None
    )
    if (recorded, world_size) != (strategy.name, strategy.world_size):
        raise RunError(
            f"run {run.id} was trained with --strategy {recorded} on {world_size} "
            f"process(es), not {strategy.name} on {strategy.world_size}",
            hint=f"`tunelab resume {run.id}` (it relaunches with the recorded strategy), or "
            "start a new run: the global batch depends on the number of processes",
        )
    strategy.barrier()
    return _held(strategy, run if strategy.is_main else follower(run.study, run.id))
