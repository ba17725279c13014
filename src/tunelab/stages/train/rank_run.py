"""The run as every rank of a distributed run holds it: rank 0 writes the records, the other
ranks follow it (same folder, no writes).

`create_run`, `follow`, `environment`, `FollowerRun`, `recorded_strategy(run_dir)` (the strategy
and world size a run was started with: resume relaunches with them, another one is refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunelab.core.errors import RunError
from tunelab.core.records import read_json
from tunelab.core.study import Run, Study
from tunelab.stages.train.launch_dir import announce_run
from tunelab.stages.train.strategy import SingleProcess, Strategy

SINGLE = "single"


class FollowerRun(Run):
    """The run as ranks other than 0 hold it: same folder, but statuses and heartbeats are
    rank 0's to write."""

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
    FollowerRun (they write no record)."""
    strategy = strategy or SingleProcess()
    run = study.create_run(kind, **kwargs) if strategy.is_main else None
    if run is not None:
        announce_run(run.id, run.dir)
    run_id, run_dir = strategy.broadcast_object((run.id, str(run.dir)) if run else None)
    return run if run is not None else FollowerRun(study, run_id, Path(run_dir))


def recorded_strategy(run_dir: Path) -> tuple[str, int]:
    """The strategy and world size a run was started with (from its env.json)."""
    env = read_json(run_dir / "env.json") if (run_dir / "env.json").exists() else {}
    d = env.get("distributed") or {}
    return d.get("strategy", SINGLE), int(d.get("world_size", 1))


def follow(strategy: Strategy | None, run: Run) -> Run:
    """Before a resumed run goes on: the strategy and world size must be the recorded ones;
    every rank has finished its checks; ranks other than 0 get a FollowerRun."""
    strategy = strategy or SingleProcess()
    recorded, world_size = recorded_strategy(run.dir)
    if (recorded, world_size) != (strategy.name, strategy.world_size):
        raise RunError(
            f"run {run.id} was trained with --strategy {recorded} on {world_size} "
            f"process(es), not {strategy.name} on {strategy.world_size}",
            hint=f"`tunelab resume {run.id}` (it relaunches with the recorded strategy), or "
            "start a new run: the global batch depends on the number of processes",
        )
    strategy.barrier()
    if strategy.is_main:
        announce_run(run.id, run.dir)
        return run
    return FollowerRun(run.study, run.id, run.dir)
