"""A plan against what the ledger holds: planned and actual durations, phase by phase.

Actual durations are the ledger's (created_at -> finished_at of each run) and the records' own
(a sizing's seconds, a verification's, an export's), for the units that ran. Each row also gives
the plan recomputed at the speed the runs themselves measured (their own mean step time, their
own evaluation seconds per example): when the machine's load changes between sizing and
training, the first error mixes the speed change with the plan's arithmetic, the second shows
the arithmetic alone.

`review_plan(study, plan=None)` (`tunelab plan --review --json`; the dossier calls it) ->
`{plan, notes, rows, largest_error, largest_error_at_run_speed, max_error_pct,
max_error_at_run_speed_pct}` (`notes`: for a GPU plan, the runs that ran elsewhere;
`largest_error`: `{phase, error_pct}` signed as the table prints it, or None); each row `{phase,
what, planned_s, actual_s, error_pct, planned_at_run_speed_s, error_at_run_speed_pct,
below_resolution, margin_pct, within_margin, far_off (|error| over `FAR_OFF_PCT` = 50 %, either
way; `far_off_remark(row)` says it), repeats_s, repeat_spread_pct, within_repeat_spread}`:
`repeats_s` holds the durations of a unit that ran more than once (the evaluations of one
split), `repeat_spread_pct` their `(max - min) / mean` (`repeat_spread`). `plan_review(study,
plan=None)` is the same review as its kind (`core.record_plan.PlanReview`), read at the plan
record's path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tunelab.core.errors import StudyError
from tunelab.core.evidence import latest, sizing_dir
from tunelab.core.record_plan import PlanReview, PlanReviewRow, PlanSchedule
from tunelab.core.record_types import Evaluation, ExportManifest, RunStatus, Sizing, Verify
from tunelab.core.records import read_jsonl
from tunelab.core.run_parts import RunEnv, TrainStep
from tunelab.core.study import Study
from tunelab.stages.plan.figures import _parse_time, run_seconds
from tunelab.stages.plan.stored import plans_dir

# A phase planned and measured under this many seconds is shown in the review but left out of
# its largest error: a process's timing varies by tenths of a second on a shared machine, and
# such a phase weighs nothing in a rental counted in hours.
RESOLUTION_S = 1.0
# A phase off by more than this, either way, is remarked on whatever its margin: a plan three
# times too long fits inside any margin and still misprices the rental.
FAR_OFF_PCT = 50.0


@dataclass(frozen=True)
class PlannedUnits:
    """What a stored plan record says each unit of work takes, in seconds."""

    plan_id: str
    smoke_s: float
    sizing_s: float
    baseline_s: float
    variant_s: float
    variant_compute_s: float  # its startup, steps and validation: what a run's speed scales
    checkpoints_s: float
    step_time_s: float
    evaluation_run_s: float
    verify_s: float
    resume_each_s: float
    export_s: float
    num_variants: int
    margins_pct: dict[str, float | None]
    eval_s_per_example: float | None
    variant_s_per_step: float | None

    @classmethod
    def from_record(cls, plan: PlanSchedule) -> PlannedUnits:
        init, v = plan.initial, plan.variant
        return cls(
            plan_id=plan.id,
            smoke_s=init.smoke,
            sizing_s=init.sizing,
            baseline_s=init.baseline,
            variant_s=v.total_s,
            variant_compute_s=v.startup_s + v.steps_s + v.validation_s,
            checkpoints_s=v.checkpoints_s,
            step_time_s=plan.step_time_s,
            evaluation_run_s=plan.evaluation_run_s,
            verify_s=plan.verify_s,
            resume_each_s=plan.resume_each_s,
            export_s=plan.export_s,
            num_variants=plan.num_variants,
            margins_pct={ph.phase: ph.margin_pct for ph in plan.phases},
            eval_s_per_example=plan.figure("eval_s_per_example"),
            variant_s_per_step=plan.figure("variant_s_per_step"),
        )


@dataclass
class ReviewRow:
    phase: str
    what: str
    planned_s: float
    actual_s: float | None
    planned_at_run_speed_s: float | None
    repeats_s: list[float] | None = None
    error_pct: float | None = None
    error_at_run_speed_pct: float | None = None
    repeat_spread_pct: float | None = None
    within_repeat_spread: bool | None = None
    below_resolution: bool = False
    margin_pct: float | None = None
    within_margin: bool | None = None
    far_off: bool = False

    def settle(self, margin: float | None) -> None:
        """The errors, and whether the phase stayed inside its margin and its repeats' spread."""
        self.error_pct = _pct(self.planned_s, self.actual_s)
        self.error_at_run_speed_pct = _pct(self.planned_at_run_speed_s, self.actual_s)
        self.repeat_spread_pct = repeat_spread(self.repeats_s or [])
        if self.error_pct is not None and self.repeat_spread_pct is not None:
            self.within_repeat_spread = abs(self.error_pct) <= self.repeat_spread_pct
        self.below_resolution = bool(
            self.error_pct is not None and max(self.planned_s, self.actual_s or 0.0) < RESOLUTION_S
        )
        # did the phase's stated margin absorb what it took? (what a rental schedule needs)
        self.margin_pct = margin
        if self.error_pct is not None and margin is not None and self.actual_s is not None:
            self.within_margin = self.actual_s <= self.planned_s * (1 + margin / 100)
        self.far_off = bool(
            self.error_pct is not None
            and abs(self.error_pct) > FAR_OFF_PCT
            and not self.below_resolution
        )


def verify_seconds(study: Study) -> list[float]:
    out = []
    for path in sorted(study.runs_dir.glob("*/verify*.json")) if study.runs_dir.is_dir() else []:
        rec = Verify.read(path)
        if rec.seconds and rec.model_run:
            out.append(float(rec.seconds))
    return out


def export_seconds(study: Study) -> list[float]:
    """Each export's duration: its ledger event's own seconds, else manifest -> event time."""
    done, seconds = {}, {}
    for e in study.ledger.events():
        detail = e.detail_object() if e.kind == "export" else {}
        if detail:
            try:
                done[detail.get("export_id")] = _parse_time(e.at)
            except ValueError:
                continue
            if isinstance(detail.get("seconds"), int | float):
                seconds[detail.get("export_id")] = float(detail["seconds"])
    out = list(seconds.values())
    for export_id, end in done.items():
        if export_id in seconds:
            continue  # timed by the export itself
        manifest = study.records / "exports" / str(export_id) / "tunelab-manifest.json"
        if manifest.exists() and end is not None:
            start = _parse_time(ExportManifest.read(manifest).created_at)
            if start is not None:
                out.append(max(0.0, (end - start).total_seconds()))
    return out


def mean_step_s(study: Study, run_id: str) -> float | None:
    """Mean seconds of a training run's optimizer steps, from its metrics.jsonl."""
    path = study.runs_dir / run_id / "metrics.jsonl"
    if not path.exists():
        return None
    lines = [TrainStep.of(path, r, f"line {i + 1}") for i, r in enumerate(read_jsonl(path))]
    steps = [r.seconds for r in lines if r.loss is not None and r.seconds]
    return sum(steps) / len(steps) if steps else None


def eval_speed_factor(study: Study, run_id: str, planned: PlannedUnits) -> float:
    """How fast an evaluation ran against the plan's unit of work: a generating one by its
    seconds per decoding step (how many steps it took is the plan's to get right), any other
    by its seconds per example. 1.0 when either side is missing."""
    for path in sorted((study.runs_dir / run_id).glob("metrics-*.json")):
        rec = Evaluation.read(path)
        if not (rec.seconds and rec.n):
            continue
        step = rec.decoding.s_per_step if rec.decoding is not None else None
        if step and planned.variant_s_per_step:
            return step / planned.variant_s_per_step
        per_example = planned.eval_s_per_example
        return rec.seconds / rec.n / per_example if per_example else 1.0
    return 1.0


def device_notes(study: Study, plan: PlanSchedule) -> list[str]:
    """Whether the runs reviewed ran where the plan is for: a GPU plan against runs on the CPU
    (or on another GPU) measures the machines, not the plan."""
    projection = plan.projection
    if projection is None:
        return []
    from tunelab.stages.plan.catalog import gpu_of_device

    elsewhere: dict[str, int] = {}
    for r in study.list_runs():
        if r.kind not in ("train", "eval", "baseline", "smoke") or r.status == "running":
            continue
        path = study.runs_dir / r.id / "env.json"
        env = RunEnv.read(path) if path.exists() else RunEnv(path, {})
        names = [g.name for g in env.devices]
        on_gpu = str(env.compute_device or "").startswith("cuda") and names
        gpu = gpu_of_device(names[0]) if on_gpu else None
        if gpu is None or gpu.id != projection.gpu:
            where = names[0] if on_gpu else str(env.compute_device or "cpu")
            elsewhere[where] = elsewhere.get(where, 0) + 1
    return [
        f"{_n(count, 'run')} ran on {where}, not on {projection.gpu_name}: their durations "
        "test the machine, not this plan"
        for where, count in elsewhere.items()
    ]


def steps_notes(study: Study, plan: PlanSchedule) -> list[str]:
    """Whether the completed training runs took the plan's steps: a run made with another
    training.max_steps (a --set) moves the experiments' error by the steps, not the plan."""
    planned = plan.variant.steps
    taken: dict[int, int] = {}
    for r in study.list_runs():
        path = study.runs_dir / r.id / "status.json"
        if r.kind != "train" or r.status != "completed" or not path.exists():
            continue
        steps = RunStatus.read(path).steps
        if steps is not None and planned and steps != planned:
            taken[steps] = taken.get(steps, 0) + 1
    return [
        f"{_n(count, 'training run')} took {steps} steps, the plan's variant {planned} "
        "(training.max_steps when it was planned): the experiments' error counts the "
        "difference in steps"
        for steps, count in sorted(taken.items())
    ]


def _row(row: PlanReviewRow | dict[str, Any]) -> PlanReviewRow:
    """A review row as its kind (a dict: a row of a review as `review_plan` returns it)."""
    return row if isinstance(row, PlanReviewRow) else PlanReviewRow.of("the review", row, "rows")


def far_off_remark(row: PlanReviewRow | dict[str, Any]) -> str | None:
    """'experiments: planned 40.0 s, took 10.0 s (+300.0 %): the plan is far longer than the
    runs' for a review row off by more than FAR_OFF_PCT either way; None otherwise."""
    r = _row(row)
    if not r.far_off or r.error_pct is None:
        return None
    way = "longer" if r.error_pct > 0 else "shorter"
    return (
        f"{r.phase}: planned {r.planned_s:.1f} s, took {r.actual_s or 0:.1f} s "
        f"({r.error_pct:+.1f} %): the plan is far {way} than the runs, whatever its margin"
    )


def _largest(rows: list[ReviewRow], key: str) -> dict[str, Any] | None:
    """The row of the largest |error| by `key`, signed as its table prints it."""
    found = [r for r in rows if getattr(r, key) is not None]
    if not found:
        return None
    top = max(found, key=lambda r: abs(getattr(r, key)))
    return {"phase": top.phase, "error_pct": getattr(top, key)}


def _n(count: int, noun: str) -> str:
    """'1 export', '2 exports'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _pct(planned: float | None, actual: float | None) -> float | None:
    return round(100 * (planned - actual) / actual, 1) if planned and actual else None


def repeat_spread(seconds: list[float]) -> float | None:
    """How much one unit of work varied when it ran more than once: (max - min) / mean, in %.

    A plan from one earlier sample cannot be closer to a phase than the phase's own units are
    to each other."""
    if len(seconds) < 2:
        return None
    mean = sum(seconds) / len(seconds)
    return round(100 * (max(seconds) - min(seconds)) / mean, 1) if mean > 0 else None


def repeat_verdict(row: PlanReviewRow | dict[str, Any]) -> str | None:
    """'evaluation: its 2 evaluations of one split took 8.7 and 7.5 s, a spread of 15.0 %; the
    phase's error -11.2 % is inside it: ...' for a review row whose unit ran more than once,
    one sentence for the CLI and the dossier; None when it ran once or nothing was measured."""
    r = _row(row)
    if r.repeat_spread_pct is None or r.error_pct is None:
        return None
    repeats = r.repeats_s or []
    times = " and ".join(f"{x:.1f}" for x in repeats)
    verdict = (
        "inside it: the plan is as close as the runs are to each other"
        if r.within_repeat_spread
        else "outside it"
    )
    return (
        f"{r.phase}: its {len(repeats)} evaluations of one split took {times} s, "
        f"a spread of {r.repeat_spread_pct:.1f} %; the phase's error "
        f"{r.error_pct:+.1f} % is {verdict}"
    )


def _rows(study: Study, planned: PlannedUnits) -> list[ReviewRow]:
    runs = [r for r in study.list_runs() if r.status != "running" and run_seconds(r) is not None]

    def of(kind: str) -> list[Any]:
        return [r for r in runs if r.kind == kind]

    smoke, baseline, train, evals = of("smoke"), of("baseline"), of("train"), of("eval")
    sizing = [Sizing.read(p).seconds or 0.0 for p in sorted(sizing_dir(study).glob("size-*.json"))]
    verify = verify_seconds(study)
    exports = export_seconds(study)
    # experiments at each run's own speed: compute scaled, checkpoint saves as planned
    at_speed_train = 0.0
    for r in train:
        step = mean_step_s(study, r.id)
        factor = step / planned.step_time_s if step and planned.step_time_s else 1.0
        at_speed_train += planned.variant_compute_s * factor + planned.checkpoints_s
    factors = [eval_speed_factor(study, r.id, planned) for r in evals]
    mean_factor = sum(factors) / len(factors) if factors else 1.0
    at_speed_eval = (
        sum(f * planned.evaluation_run_s for f in factors)
        + len(verify) * planned.verify_s * mean_factor
    )
    # the same unit run more than once: the evaluations of one split (eval-validation, ...)
    same_unit: dict[str, list[float]] = {}
    for r in evals:
        same_unit.setdefault(r.name or "eval", []).append(run_seconds(r))
    repeated = max(same_unit.values(), key=len, default=[])
    # a run interrupted then resumed to the end counts too: its ledger keeps the interruption
    stopped = {e.run_id for e in study.ledger.events() if e.kind == "status:interrupted"}
    interrupted = [r for r in train if r.status == "interrupted" or r.id in stopped]
    resumed = sum(r.status != "interrupted" for r in interrupted)
    return [
        ReviewRow(
            "initial check",
            f"{len(smoke)} smoke, {len(sizing)} sizing, {len(baseline)} baseline "
            "(measured before planning)",
            (planned.smoke_s if smoke else 0)
            + (planned.sizing_s if sizing else 0)
            + (planned.baseline_s if baseline else 0),
            (run_seconds(smoke[-1]) if smoke else 0)
            + (sizing[-1] if sizing else 0)
            + (run_seconds(baseline[-1]) if baseline else 0),
            None,
        ),
        ReviewRow(
            "experiments",
            f"{len(train)} of {_n(planned.num_variants, 'training run')}",
            len(train) * planned.variant_s,
            sum(run_seconds(r) for r in train),
            at_speed_train if train else None,
        ),
        ReviewRow(
            "evaluation",
            f"{_n(len(evals), 'evaluation')}, {_n(len(verify), 'verification')}",
            len(evals) * planned.evaluation_run_s + len(verify) * planned.verify_s,
            sum(run_seconds(r) for r in evals) + sum(verify),
            at_speed_eval if evals else None,
            repeats_s=repeated if len(repeated) > 1 else None,
        ),
        ReviewRow(
            "resumption margin",
            _n(len(interrupted), "interrupted run") + (f" ({resumed} resumed)" if resumed else ""),
            planned.resume_each_s * planned.num_variants,
            None,
            None,
        ),
        ReviewRow(
            "export",
            _n(len(exports), "export"),
            len(exports) * planned.export_s,
            sum(exports),
            None,
        ),
    ]


def review_plan(study: Study, plan: PlanSchedule | dict[str, Any] | None = None) -> dict[str, Any]:
    """Planned against actual, phase by phase, for the units the ledger holds: `{plan, rows,
    max_error_pct, max_error_at_run_speed_pct}` (the record `tunelab plan --review --json`
    prints). `plan` is a plan record read back, or one as written (its `_path` where it was
    read from, if any); None: the latest. A damaged plan record raises the located
    StudyError."""
    return plan_review(study, plan).raw


def plan_review(study: Study, plan: PlanSchedule | dict[str, Any] | None = None) -> PlanReview:
    """`review_plan`'s review as its kind, read at the plan record's path."""
    schedule = _schedule(study, plan)
    return PlanReview.of(schedule.path, _review(study, schedule))


def _schedule(study: Study, plan: PlanSchedule | dict[str, Any] | None) -> PlanSchedule:
    """The plan to review as its kind: the latest, one read back, or one as written."""
    if plan is None:
        found = latest(study, "plan")
        if found is None:
            raise StudyError("no plan in records/plans/", hint="make one first: `tunelab plan`")
        return PlanSchedule.read(found.path)
    if isinstance(plan, PlanSchedule):
        return plan
    where = plan.get("_path") or plans_dir(study) / f"{plan.get('id')}.json"
    return PlanSchedule.of(where, plan)


def _review(study: Study, schedule: PlanSchedule) -> dict[str, Any]:
    """The review of `schedule` as `review_plan` returns it."""
    planned = PlannedUnits.from_record(schedule)
    rows = _rows(study, planned)
    for r in rows:
        r.settle(planned.margins_pct.get(r.phase))
    measured = [
        r
        for r in rows
        if r.error_pct is not None and r.phase != "initial check" and not r.below_resolution
    ]
    at_speed = [r for r in rows if r.error_at_run_speed_pct is not None]
    return {
        "plan": planned.plan_id,
        "notes": device_notes(study, schedule) + steps_notes(study, schedule),
        "rows": [asdict(r) for r in rows],
        "largest_error": _largest(measured, "error_pct"),
        "largest_error_at_run_speed": _largest(at_speed, "error_at_run_speed_pct"),
        "max_error_pct": max((abs(r.error_pct) for r in measured), default=None),  # type: ignore[arg-type]
        "max_error_at_run_speed_pct": max(
            (abs(r.error_at_run_speed_pct) for r in at_speed),  # type: ignore[arg-type]
            default=None,
        ),
    }
