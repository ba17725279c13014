"""How close can a plan be to an evaluation phase on this machine? The same evaluation, repeated.

    python benchmarks/plan_accuracy.py STUDY                # 4 rounds
    python benchmarks/plan_accuracy.py STUDY --rounds 8

STUDY is a finished demo study (`tunelab demo --dir STUDY`, or any study with a plan, a
baseline and a completed training run). The script copies it to a temporary folder (the
original's records are left as they were) and, round after round, runs `tunelab baseline` and
`tunelab eval RUN` (RUN: the study's first completed training run), each as a user runs it, in its
own process. From the copy's ledger (created_at -> finished_at, what `tunelab plan --review`
reads) it prints, per command: runs, mean, standard deviation, coefficient of variation, min, max,
with the model load and the evaluation proper apart (from each run's metrics record).

Then the two figures a plan is judged by:
- the plan's evaluation run (`evaluation_run_s` of the study's latest plan) against each
  evaluation: how many land within 10 %;
- the floor under any plan made from one earlier sample: every evaluation taken as the plan of
  every other one (a plan that had measured one of these very runs exactly), within 10 % in how
  many of the pairs.

And for a phase of three such processes (the demo's evaluation phase: two evaluations and a
verification), over every three of the evaluations taken as one phase: how often a plan exact to
their mean lands within 10 % of it, and how often a plan from one other run does.

The last line reads `eval_cv_pct=X plan_within_10pct=k/n one_sample_within_10pct=m/pairs
phase_exact_plan_within_10pct=a/b phase_one_sample_within_10pct=c/d`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tunelab.core.evidence import latest
from tunelab.core.record_types import Plan
from tunelab.core.records import read_json
from tunelab.core.study import Study
from tunelab.stages.plan import run_seconds

# the demo's evaluation phase: two evaluations and a verification, each its own process
PHASE_PROCESSES = 3


def _tunelab(study: Path, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "tunelab", args[0], "--study", str(study), *args[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[2:])} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def _units(study: Study, kind: str, after: set[str]) -> list[dict[str, float]]:
    """Duration, load and evaluation seconds of each new completed run of `kind`."""
    out = []
    for row in study.list_runs(kind):
        if row.id in after or row.status != "completed":
            continue
        rec = read_json(study.runs_dir / row.id / "metrics-validation.json")
        out.append(
            {"duration": run_seconds(row), "load": rec.get("load_s"), "eval": rec.get("seconds")}
        )
    return out


def _stats(values: list[float]) -> list[str]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return [
        str(len(values)),
        f"{mean:.2f}",
        f"{sd:.2f}",
        f"{100 * sd / mean:.1f}",
        f"{min(values):.2f}",
        f"{max(values):.2f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    original = Study.open(args.study)
    found = latest(original, "plan")
    plan = None if found is None else Plan.read(found.path)
    trained = [r for r in original.list_runs("train") if r.status == "completed"]
    if plan is None or not trained:
        sys.exit(f"{args.study}: needs a plan and a completed training run (run `tunelab demo`)")
    console = Console()
    with tempfile.TemporaryDirectory(prefix="tunelab-plan-accuracy-") as tmp:
        copy = Path(tmp) / "study"
        shutil.copytree(args.study, copy)
        study = Study.open(copy)
        before = {r.id for r in study.list_runs()}
        with console.status("") as status:
            for i in range(args.rounds):
                status.update(f"round {i + 1} of {args.rounds}: baseline")
                _tunelab(copy, "baseline")
                status.update(f"round {i + 1} of {args.rounds}: eval {trained[0].id}")
                _tunelab(copy, "eval", trained[0].id)
        units = {kind: _units(study, kind, before) for kind in ("baseline", "eval")}
    table = Table(title=f"{args.rounds} rounds on {args.study} (seconds)")
    for col in ("command", "part", "runs", "mean", "sd", "cv %", "min", "max"):
        table.add_column(col)
    for kind, rows in units.items():
        for part in ("duration", "load", "eval"):
            values = [r[part] for r in rows if r[part] is not None]
            if values:
                table.add_row(f"tunelab {kind}", part, *_stats(values))
    console.print(table)
    evals = [r["duration"] for r in units["eval"]]
    planned = plan.raw["evaluation_run_s"]
    within = sum(abs(planned - x) <= 0.1 * x for x in evals)
    # every run as the plan of every other: a plan that had measured one of these very runs
    pairs = [(a, x) for i, a in enumerate(evals) for j, x in enumerate(evals) if i != j]
    floor = sum(abs(a - x) <= 0.1 * x for a, x in pairs)
    cv = 100 * statistics.stdev(evals) / statistics.fmean(evals)
    exact, from_one = _phase_floors(evals)
    console.print(
        f"plan {plan.id}: an evaluation run planned at {planned:.2f} s; "
        f"within 10 % of {within} of {len(evals)} evaluations"
    )
    print(
        json.dumps({"planned_s": planned, "evaluations_s": evals}),
        f"\neval_cv_pct={cv:.1f} plan_within_10pct={within}/{len(evals)} "
        f"one_sample_within_10pct={floor}/{len(pairs)} "
        f"phase_exact_plan_within_10pct={exact[0]}/{exact[1]} "
        f"phase_one_sample_within_10pct={from_one[0]}/{from_one[1]}",
    )


def _phase_floors(evals: list[float], size: int = PHASE_PROCESSES) -> tuple[tuple, tuple]:
    """The demo's evaluation phase is `size` processes. Over every `size` of these runs taken as
    one phase: how often a plan exact to the runs' mean (`size` x mean) lands within 10 % of it,
    and how often a plan from one other run (`size` x that run) does. (hits, cases) each."""
    mean = statistics.fmean(evals)
    exact = [0, 0]
    one = [0, 0]
    for phase in itertools.combinations(range(len(evals)), size):
        actual = sum(evals[i] for i in phase)
        exact[0] += abs(size * mean - actual) <= 0.1 * actual
        exact[1] += 1
        for j in set(range(len(evals))) - set(phase):
            one[0] += abs(size * evals[j] - actual) <= 0.1 * actual
            one[1] += 1
    return tuple(exact), tuple(one)


if __name__ == "__main__":
    main()
