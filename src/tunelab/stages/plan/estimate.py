"""The plan of a rental from its figures: pure arithmetic, values in, a `Plan` out.

The phases of a rental: initial check (environment, smoke, sizing, baseline), experiments (each
variant's training run as the ledger times it: tokenization, model load, steps, validation
losses, checkpoint saves), evaluation (each variant's validation evaluation, a fresh-process
verification, the one final test), a resumption margin (one interruption per variant: the lost
half checkpoint interval, a restart, and a checkpoint re-inspected in a new process), and
export. Each phase carries an explicit margin. The plan says how many variants fit the rental
window, warns when the registered number does not, and gives the cost.

The figures are those of the device that measured them (or of a projection to a catalog GPU,
`tunelab.stages.plan.project`); `speedup` or `step_time_s` scale a plan by hand.

`build_plan(figures, cfg, *, days, gpu_hour_price=None, speedup=1.0, step_time_s=None) ->
Plan`; the steps of a variant are `tunelab.stages.train.schedule.total_steps`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.env import BUSY_CPU_SHARE
from tunelab.stages.plan.figures import Figures
from tunelab.stages.train.schedule import total_steps

PHASES = ("initial check", "experiments", "evaluation", "resumption margin", "export")
# Margin added to each phase for run-to-run variation (the resumption phase is itself a margin).
MARGINS = {
    "initial check": 0.10,
    "experiments": 0.15,
    "evaluation": 0.10,
    "resumption margin": 0.0,
    "export": 0.25,
}
ENV_CHECK_S = 5.0
PROCESS_START_S = 3.0  # a new Python process importing torch (when no smoke measured one)
EXPORT_FIXED_S = 0.05  # records read, the comparison, manifest and model card written


@dataclass
class VariantRun:
    """One variant's training run, in seconds."""

    startup_s: float
    steps: int
    steps_s: float
    validation_passes: int
    validation_s: float
    checkpoint_saves: int
    checkpoints_s: float
    total_s: float = 0.0

    def __post_init__(self) -> None:
        self.total_s = self.startup_s + self.steps_s + self.validation_s + self.checkpoints_s


@dataclass
class InitialCheck:
    environment: float
    smoke: float
    sizing: float
    baseline: float

    @property
    def total_s(self) -> float:
        return self.environment + self.smoke + self.sizing + self.baseline


@dataclass
class Phase:
    phase: str
    start_s: float
    planned_s: float
    margin_s: float
    margin_pct: int
    total_s: float


@dataclass
class Cost:
    busy_hours: float
    busy_cost: float
    rental_hours: int
    rental_cost: float


@dataclass
class Plan:
    days: int
    hours_per_day: float
    gpu: str | None
    gpu_hour_price: float
    speedup: float
    step_time_s: float
    num_variants: int
    variants_that_fit: int
    fits: bool
    variant: VariantRun
    per_variant_with_margins_s: float
    evaluation_run_s: float
    final_test_s: float
    verify_s: float
    resume_each_s: float
    export_s: float
    initial: InitialCheck
    phases: list[Phase]
    busy_s: float
    window_s: float
    cost: Cost
    device: str = ""  # what the durations are for: this machine, a given speed, a projected GPU
    warnings: list[str] = field(default_factory=list)
    margins: dict[str, float] = field(default_factory=lambda: dict(MARGINS))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def training_run(figures: Figures, cfg: StudyConfig, step_s: float, forward_s: float) -> VariantRun:
    """One variant's training run: tokenization and load, the steps (`train`'s own count), the
    validation passes and the checkpoint saves its config asks for."""
    t = cfg.training
    n_train, n_val = figures.counts.train, figures.counts.validation
    steps = total_steps(cfg, n_train)
    encode_s = figures.encode_s.seconds * (n_train + n_val) / max(1, n_train)
    n_val_passes = 0
    if t.eval_every_steps and n_val:
        every = t.eval_every_steps
        n_val_passes = 1 + steps // every + (1 if steps % every else 0)
    val_pass_s = math.ceil(n_val / t.micro_batch_size) * forward_s if n_val else 0.0
    every_ckpt = t.checkpoint_every_steps
    n_saves = (steps // every_ckpt + (1 if steps % every_ckpt else 0)) if every_ckpt else 1
    return VariantRun(
        startup_s=encode_s + figures.load_s.seconds,
        steps=steps,
        steps_s=steps * step_s,
        validation_passes=n_val_passes,
        validation_s=n_val_passes * val_pass_s,
        checkpoint_saves=n_saves,
        checkpoints_s=n_saves * figures.checkpoint_save_s.seconds,
    )


@dataclass
class Evaluations:
    """A variant's evaluation, the final test and the fresh-process verification, in seconds."""

    run_s: float
    final_test_s: float
    verify_s: float


def evaluations(figures: Figures, speedup: float) -> Evaluations:
    """An evaluation run is the baseline's unit of work again (the split, the records), with a
    variant's load (see `figures.adapted_costs`); a load is files and imports: no faster device
    speeds it. `evaluation.max_examples` caps every evaluation, not training's validation."""
    n_val, n_test = figures.counts.validation, figures.counts.test
    cap = figures.eval_max_examples or max(n_val, n_test)
    eval_val, eval_test = min(n_val, cap), min(n_test, cap)
    eval_per_ex = figures.eval_s_per_example.seconds / speedup
    # a variant's example beside the baseline's: the length it generates, the adapter's matmuls
    extra = 0.0
    for fig in (figures.answer_length_s_per_example, figures.adapted_extra_s_per_example):
        extra += fig.seconds if fig is not None else 0.0
    extra /= speedup
    baseline_s = figures.baseline_s.seconds
    if baseline_s:
        base_load = figures.baseline_load_s.seconds if figures.baseline_load_s else 0.0
        eval_load = (figures.eval_load_s.seconds if figures.eval_load_s else 0.0) or base_load
        run_s = max(0.0, baseline_s - base_load) / speedup + eval_load
    else:
        run_s = figures.reload_s.seconds + eval_val * eval_per_ex
    # a merged variant: the copy and its first-batch check, once per evaluation
    run_s += figures.eval_merge_s.seconds if figures.eval_merge_s is not None else 0.0
    run_s = max(0.0, run_s + eval_val * extra)
    per_example = max(0.0, eval_per_ex + extra)
    overhead_s = max(0.0, run_s - eval_val * per_example)
    # the same evaluation in a new process: its start and imports as the smoke's fresh one took
    start = figures.process_start_s.seconds or PROCESS_START_S
    return Evaluations(run_s, overhead_s + eval_test * per_example, run_s + start)


def _phases(raw: dict[str, float]) -> list[Phase]:
    phases, clock = [], 0.0
    for name in PHASES:
        base = raw[name]
        margin = MARGINS[name] * base
        phases.append(Phase(name, clock, base, margin, round(100 * MARGINS[name]), base + margin))
        clock += base + margin
    return phases


def _busy_warnings(figures: Figures, speedup: float, step_time_s: float | None) -> list[str]:
    """What makes the measured figures slower than the machine can be, and a CPU plan's scope."""
    warnings = []
    load, cores = figures.load_avg_at_sizing, figures.logical_cores
    if load and cores and load > cores:
        warnings.append(
            f"the step was measured on a busy machine (load average {load:g} on {cores} cores): "
            "durations scale with the load at run time; `tunelab plan --review` shows both"
        )
    measured_busy = {  # what was timed: (its CPU share, what it prices, the command again)
        "the sizing's timed steps": (figures.step_cpu_share, "training step", "size"),
        "the baseline's evaluation": (figures.baseline_cpu_share, "evaluation", "baseline"),
    }
    for what, (share, priced, command) in measured_busy.items():
        if share is not None and share < BUSY_CPU_SHARE:
            warnings.append(
                f"{what} had {100 * share:.0f} % of its threads' CPU time (about 95 % on a "
                f"quiet machine): another process shared the cores, and every {priced} in this "
                f"plan is priced at that slower speed; run `tunelab {command}` again on a quiet "
                "machine, then plan"
            )
    if figures.device == "cpu" and speedup == 1.0 and not step_time_s:
        warnings.append(
            "figures measured on CPU: this is a plan for this CPU; --gpu ID projects it onto "
            "a catalog GPU (--compare-gpus lists them), --speedup X or --step-time-s S scales it"
        )
    return warnings


def plan_device(figures: Figures, gpu: str, speedup: float, step_time_s: float | None) -> str:
    """What the plan's durations are for, as its title names it: the device that measured the
    figures, or the budget's GPU at a speed-up or step time the user gave."""
    if step_time_s:
        return f"{gpu} (its step time given: {step_time_s:g} s)"
    if speedup != 1.0:
        return f"{gpu} ({speedup:g} x this machine's speed, as given)"
    return "this machine's CPU" if figures.device == "cpu" else f"this machine's {figures.device}"


def variants_in_window(window_s: float, busy_s: float, n_var: int, per_variant_s: float) -> int:
    """How many variants fit a rental window: what the plan spends besides its `n_var`
    variants (`busy_s` holds both) is fixed, each more variant takes `per_variant_s`."""
    fixed_s = busy_s - n_var * per_variant_s
    return max(0, int((window_s - fixed_s) // per_variant_s)) if per_variant_s > 0 else n_var


def _export_seconds(figures: Figures) -> float:
    """An export hashes the base (the check that it did not change since training), copies the
    trained weights and hashes the copy (about one save); a freeze run loads its model to save
    it whole."""
    export_s = figures.base_hash_s.seconds + figures.checkpoint_save_s.seconds + EXPORT_FIXED_S
    if figures.method == "freeze":
        export_s += figures.load_s.seconds
    return export_s


def _initial_check(
    figures: Figures, variant: VariantRun, ev: Evaluations, step_s: float, speedup: float
) -> InitialCheck:
    """The protocol's first day: environment, smoke, sizing and baseline, as recorded or, for
    one not run yet, from the step and evaluation times."""
    eval_per_ex = figures.eval_s_per_example.seconds / speedup
    eval_val = min(figures.counts.validation, figures.eval_max_examples or 1 << 62)
    return InitialCheck(
        environment=ENV_CHECK_S,
        smoke=figures.smoke_s.seconds or (variant.startup_s + 4 * step_s + ev.run_s),
        sizing=figures.sizing_s.seconds,
        baseline=figures.baseline_s.seconds or (figures.load_s.seconds + eval_val * eval_per_ex),
    )


def build_plan(
    figures: Figures,
    cfg: StudyConfig,
    *,
    days: int,
    gpu_hour_price: float | None = None,
    speedup: float = 1.0,
    step_time_s: float | None = None,
) -> Plan:
    """Phases, durations (s), margins, what fits, cost. Pure: values in, values out."""
    speedup = float(speedup or 1.0)
    budget = cfg.budget
    price = float(budget.gpu_hour_price if gpu_hour_price is None else gpu_hour_price)
    step_s = step_time_s if step_time_s else figures.step_s.seconds / speedup
    variant = training_run(figures, cfg, step_s, figures.forward_s.seconds / speedup)
    ev = evaluations(figures, speedup)
    interval = min(cfg.training.checkpoint_every_steps or variant.steps, variant.steps)
    resume_each = interval / 2 * step_s + variant.startup_s + figures.reload_s.seconds
    export_s = _export_seconds(figures)
    initial = _initial_check(figures, variant, ev, step_s, speedup)
    n_var = int(budget.num_variants)
    phases = _phases(
        {
            "initial check": initial.total_s,
            "experiments": n_var * variant.total_s,
            "evaluation": n_var * ev.run_s + ev.verify_s + ev.final_test_s,
            "resumption margin": n_var * resume_each,
            "export": export_s,
        }
    )
    window_s = days * float(budget.hours_per_day) * 3600.0
    busy_s = phases[-1].start_s + phases[-1].total_s
    per_variant_s = (
        variant.total_s * (1 + MARGINS["experiments"])
        + ev.run_s * (1 + MARGINS["evaluation"])
        + resume_each
    )
    fit = variants_in_window(window_s, busy_s, n_var, per_variant_s)
    warnings = []
    if fit < n_var:
        warnings.append(
            f"{n_var} registered variants do not fit {days} days x {budget.hours_per_day:g} "
            f"h: {fit} fit (each needs {per_variant_s / 3600:.2f} h with margins)"
        )
    return Plan(
        days=days,
        hours_per_day=budget.hours_per_day,
        gpu=budget.gpu,
        gpu_hour_price=price,
        speedup=speedup,
        step_time_s=step_s,
        num_variants=n_var,
        variants_that_fit=fit,
        fits=fit >= n_var,
        variant=variant,
        per_variant_with_margins_s=per_variant_s,
        evaluation_run_s=ev.run_s,
        final_test_s=ev.final_test_s,
        verify_s=ev.verify_s,
        resume_each_s=resume_each,
        export_s=export_s,
        initial=initial,
        phases=phases,
        busy_s=busy_s,
        window_s=window_s,
        cost=Cost(busy_s / 3600, busy_s / 3600 * price, days * 24, days * 24 * price),
        device=plan_device(figures, budget.gpu, speedup, step_time_s),
        warnings=warnings + _busy_warnings(figures, speedup, step_time_s),
    )
