"""Start or resume a run by its name: the command a preempted or requeued job runs again.

`tunelab train --name NAME --resume-if-exists` starts the training run NAME when the study has
none of that name, resumes it (from its latest complete checkpoint, to the result of an
uninterrupted run) when it was interrupted or failed, and reports it when it completed. It never
starts a second run of the same name: a run still running (a live process with a fresh
heartbeat) and an invalid one are refused with `resume`'s reasons.

Rank 0 looks the name up in its records (node 0's) and tells the other ranks which run it is,
so that every rank takes the same branch.

`train_or_resume(study, name, ..., strategy) -> (run, action)` with action "started",
"resumed" or "completed" (nothing to do).
"""

from __future__ import annotations

from typing import Any

from tunelab.core.study import Run, Study
from tunelab.stages.train import stage as train_stage
from tunelab.stages.train.resume import resume_run
from tunelab.stages.train.stage import RUN_KIND
from tunelab.stages.train.strategy import SingleProcess, Strategy


def named_run(study: Study, name: str, strategy: Strategy | None) -> tuple[str, str] | None:
    """(id, status) of the training run called `name` as rank 0's records hold it, on every
    rank; None where there is none. A run left `running` by a killed process is found
    interrupted first (its heartbeat is stale or its process gone)."""
    strategy = strategy or SingleProcess()
    found = None
    if strategy.is_main:
        study.reconcile()
        rows = [r for r in study.ledger.list_runs(RUN_KIND) if r.name == name]
        found = (rows[-1].id, rows[-1].status) if rows else None
    return strategy.broadcast_object(found)


def train_or_resume(
    study: Study,
    name: str,
    *,
    strategy: Strategy | None = None,
    **train_options: Any,
) -> tuple[Run, str]:
    """The run `name`, trained to its end: started, resumed or already completed (see the
    module). `train_options` go to `train_stage.run` (parent, why, progress, platform_why); a resume
    takes `progress` and `platform_why` of them."""
    found = named_run(study, name, strategy)
    if found is None:
        return train_stage.run(study, name=name, strategy=strategy, **train_options), "started"
    run_id, status = found
    if status == "completed":
        return Run(study, run_id, study.runs_dir / run_id), "completed"
    resumed = resume_run(
        study,
        run_id,
        progress=train_options.get("progress"),
        strategy=strategy,
        platform_why=train_options.get("platform_why"),
    )
    return resumed, "resumed"
