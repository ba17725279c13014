"""Typed pieces of a plan record (`records/plans/<id>.json`, `core.record_types.Plan`) and of
what the plan stage hands the CLI, read the way `core.record_base.Record` reads a record: each
piece checks its fields and raises the located `StudyError` of a damaged record naming the
file, the place and the field.

| piece               | where                                            | written by           |
|---------------------|--------------------------------------------------|----------------------|
| `PlanSchedule`      | a plan record, whole: its durations              | stages.plan.estimate |
| `PlanInitial`       | `initial`                                        | stages.plan.estimate |
| `PlanVariant`       | `variant`                                        | stages.plan.estimate |
| `PlanPhase`         | `phases[i]`                                      | stages.plan.estimate |
| `PlanFigure`        | `figures.<name>`                                 | stages.plan.figures  |
| `PlanProjection`    | `projection` (a `--gpu` plan)                    | stages.plan.stage    |
| `ProjectionFit`     | `projection.fit`                                 | stages.plan.project  |
| `ProjectionStep`    | `projection.step`                                | stages.plan.project  |
| `ProjectionShare`   | `projection.utilization`                         | stages.plan.catalog  |
| `ProjectionInput`   | `projection.inputs[i]`, a comparison's `inputs`  | stages.plan.project  |
| `PlanLoad`          | `projection.fit.load`, a sizing record's `load[i]` | stages.sizing.load |
| `PlanReview`        | `review` (`tunelab plan --review`)               | stages.plan.review   |
| `PlanReviewRow`     | `review.rows[i]`                                 | stages.plan.review   |
| `PlanError`         | `review.largest_error*`                          | stages.plan.review   |
| `GpuComparison`     | `tunelab plan --compare-gpus` (not recorded)     | stages.plan.stage    |
| `GpuLayout`         | its `rows[i]`, `layouts[i]`                      | stages.plan.stage    |
| `RentalOption`      | what `cheapest_rental` chooses from              | stages.plan.stage    |
| `RentalAnswer`      | its `answer`                                     | stages.plan.stage    |
| `FitCandidate`      | a recommendation's `candidates[i]`               | stages.sizing.recommend |

Pieces of other records that the plan reads: `PlanModelFacts` (a sizing record's `facts`) and
`DecodingBatch` (an evaluation's `generation.batches[i]`).

`PlanSchedule` reads a whole plan record: `Plan`'s identity and the durations the review sets
against the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from tunelab.core.record_base import Record, damaged
from tunelab.core.record_types import Plan

R = TypeVar("R", bound=Record)


def required(record: Record, cls: type[R], name: str) -> R:
    """The piece `name` of `record` as `cls`; a record without it is damaged."""
    found = record.part(cls, name)
    if found is None:
        at = f"{record.where}: " if record.where else ""
        raise damaged(record.path, f"{at}field {name!r} is missing")
    return found


__all__ = [
    "FitCandidate",
    "GpuComparison",
    "GpuLayout",
    "PlanError",
    "PlanFigure",
    "PlanInitial",
    "DecodingBatch",
    "PlanLoad",
    "PlanModelFacts",
    "PlanPhase",
    "PlanProjection",
    "PlanReview",
    "PlanReviewRow",
    "PlanSchedule",
    "PlanVariant",
    "ProjectionFit",
    "ProjectionInput",
    "ProjectionShare",
    "ProjectionStep",
    "RentalAnswer",
    "RentalOption",
    "required",
]


@dataclass(frozen=True)
class PlanInitial(Record):
    """The protocol's first day, in seconds: the smoke, the sizing and the baseline."""

    environment: float | None = None
    smoke: float = 0.0
    sizing: float = 0.0
    baseline: float = 0.0


@dataclass(frozen=True)
class PlanVariant(Record):
    """One variant's training run as planned, in seconds (`steps`: its optimizer steps)."""

    startup_s: float = 0.0
    steps: int = 0
    steps_s: float = 0.0
    validation_passes: int | None = None
    validation_s: float = 0.0
    checkpoint_saves: int | None = None
    checkpoints_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class PlanPhase(Record):
    """One phase of the plan: its name, seconds and margin."""

    phase: str = ""
    start_s: float | None = None
    planned_s: float | None = None
    total_s: float | None = None
    margin_pct: float | None = None


@dataclass(frozen=True)
class PlanFigure(Record):
    """One input figure of the plan, with its source."""

    value: float | None = None
    source: str | None = None


@dataclass(frozen=True)
class PlanLoad(Record):
    """The load-time peak in bytes (`stages.sizing.load.LoadPeak`): a projection's, or a row of
    the sizing's load table, which also names its ranks, strategy and problem."""

    mode: str  # "whole" | "sharded"
    device_per_rank: float
    host_per_rank: float
    host_per_node: float
    why: str
    weights: float | None = None  # the base's weights, all ranks together
    ranks: int | None = None
    strategy: str | None = None
    problem: str | None = None  # why the layout cannot load (None: it can)


@dataclass(frozen=True)
class ProjectionFit(Record):
    """The micro-batch a projection chose for the GPU, per rank, and its peak (bytes)."""

    fits: bool
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    peak_bytes: float
    budget_bytes: float
    reason: str | None = None

    @property
    def load(self) -> PlanLoad | None:
        return self.part(PlanLoad, "load")

    def check_parts(self) -> None:
        _ = self.load


@dataclass(frozen=True)
class ProjectionStep(Record):
    """A projected optimizer step (seconds) over the utilization's range."""

    value: float
    low: float
    high: float
    bound: str  # "compute" | "host"
    flops: float


@dataclass(frozen=True)
class ProjectionShare(Record):
    """The share of the matrix peak a projection assumed, its range and source."""

    low: float
    value: float
    high: float
    source: str | None = None


@dataclass(frozen=True)
class ProjectionInput(Record):
    """One input of a projection: measured, read, datasheet, given or assumed."""

    name: str
    value: str
    source: str
    kind: str


@dataclass(frozen=True)
class PlanProjection(Record):
    """How a `--gpu` plan was projected (`stages.plan.project.Projection` with its price): the
    catalog GPU, the layout, the fit, the step and the inputs."""

    gpu: str = ""
    gpu_name: str | None = None
    currency: str | None = None  # the catalog's prices'
    gpus: int | None = None
    nodes: int | None = None
    strategy: str | None = None
    precision: str | None = None
    eval_s_per_example: float | None = None
    price_per_gpu_hour: float | None = None
    price_source: str | None = None

    @property
    def fit(self) -> ProjectionFit:
        return required(self, ProjectionFit, "fit")

    @property
    def step(self) -> ProjectionStep:
        return required(self, ProjectionStep, "step")

    @property
    def utilization(self) -> ProjectionShare:
        return required(self, ProjectionShare, "utilization")

    @property
    def inputs(self) -> list[ProjectionInput]:
        return self.parts(ProjectionInput, "inputs")

    def check_parts(self) -> None:
        pieces = (
            (ProjectionFit, "fit"),
            (ProjectionStep, "step"),
            (ProjectionShare, "utilization"),
        )
        for cls, name in pieces:
            self.part(cls, name)
        _ = self.inputs


@dataclass(frozen=True)
class PlanSchedule(Plan):
    """A plan record with the durations the review reads back (`Plan` is its identity)."""

    step_time_s: float = 0.0
    busy_s: float | None = None
    window_s: float | None = None
    evaluation_run_s: float = 0.0
    verify_s: float = 0.0
    resume_each_s: float = 0.0
    export_s: float = 0.0
    num_variants: int = 0

    @property
    def initial(self) -> PlanInitial:
        return required(self, PlanInitial, "initial")

    @property
    def variant(self) -> PlanVariant:
        return required(self, PlanVariant, "variant")

    @property
    def phases(self) -> list[PlanPhase]:
        return self.parts(PlanPhase, "phases")

    @property
    def projection(self) -> PlanProjection | None:
        return self.part(PlanProjection, "projection")

    def figure(self, name: str) -> float | None:
        """The value of input figure `name` (None where the plan has none)."""
        found = self.input_figure(name)
        return found.value if found is not None else None

    def input_figure(self, name: str) -> PlanFigure | None:
        """Input figure `name` with its source (None where the plan has none; `figures` also
        holds values that are not figures: the device, the counts, the method)."""
        figures = self.raw.get("figures") or {}
        if not isinstance(figures, dict) or figures.get(name) is None:
            return None
        return PlanFigure.of(self.path, figures[name], f"figures.{name}")

    def check_parts(self) -> None:
        _ = self.initial, self.variant, self.phases, self.projection


@dataclass(frozen=True)
class PlanReviewRow(Record):
    """One phase of a review (`stages.plan.review.ReviewRow`): planned against actual, in
    seconds, and what the errors mean."""

    phase: str
    what: str
    planned_s: float
    actual_s: float | None = None
    planned_at_run_speed_s: float | None = None
    repeats_s: list[float] | None = None
    error_pct: float | None = None
    error_at_run_speed_pct: float | None = None
    repeat_spread_pct: float | None = None
    within_repeat_spread: bool | None = None
    below_resolution: bool | None = None
    margin_pct: float | None = None
    within_margin: bool | None = None
    far_off: bool | None = None


@dataclass(frozen=True)
class PlanError(Record):
    """A review's largest phase error, signed as its table prints it."""

    phase: str
    error_pct: float


@dataclass(frozen=True)
class PlanReview(Record):
    """A plan set against the ledger (`stages.plan.review.review_plan`; a plan record's
    `review`)."""

    plan: str
    notes: list[str] | None = None
    max_error_pct: float | None = None
    max_error_at_run_speed_pct: float | None = None

    @property
    def rows(self) -> list[PlanReviewRow]:
        return self.parts(PlanReviewRow, "rows")

    @property
    def largest_error(self) -> PlanError | None:
        return self.part(PlanError, "largest_error")

    @property
    def largest_error_at_run_speed(self) -> PlanError | None:
        return self.part(PlanError, "largest_error_at_run_speed")

    def check_parts(self) -> None:
        _ = self.rows, self.largest_error, self.largest_error_at_run_speed


@dataclass(frozen=True)
class RentalOption(Record):
    """What a rental answer is chosen from: a layout's fit, variants and cost."""

    gpu: str
    fits: bool
    variants: dict[int, int]  # the variants that fit a rental of 3, 7 and 30 days
    rental_cost: float
    busy_hours: float
    gpus: int | None = None  # a multi-GPU layout's
    strategy: str | None = None


@dataclass(frozen=True)
class GpuLayout(RentalOption):
    """One layout `tunelab plan --compare-gpus` tried: a catalog GPU on `gpus` GPUs a node."""

    name: str = ""
    arch: str = ""
    why_not: str | None = None
    micro_batch: int = 0
    grad_accum: int = 0
    checkpointing: bool = False
    peak_bytes: float = 0.0
    memory_bytes: float = 0.0
    experts: str | None = None  # where an MoE's experts lie
    step_s: float = 0.0
    bound: str = ""
    utilization: float = 0.0
    utilization_measured: bool = False
    hours_per_variant: float = 0.0
    busy_cost: float = 0.0

    @property
    def load(self) -> PlanLoad | None:
        return self.part(PlanLoad, "load")

    @property
    def others(self) -> list[GpuLayout]:
        """A GPU's largest refusal: the other strategies tried at its size."""
        return self.parts(GpuLayout, "others")

    def check_parts(self) -> None:
        _ = self.load, self.others


@dataclass(frozen=True)
class RentalAnswer(Record):
    """The cheapest rental holding the registered variants, or why there is none."""

    gpu: str | None = None
    why: str | None = None
    days: int | None = None
    rental_cost: float | None = None
    busy_hours: float | None = None
    gpus: int | None = None
    strategy: str | None = None


@dataclass(frozen=True)
class GpuComparison(Record):
    """`tunelab plan --compare-gpus` (`stages.plan.stage.compare_gpus`; nothing is recorded)."""

    days: int
    gpus: list[int]
    num_variants: int
    currency: str
    notes: list[str]
    sources: dict[str, str]  # {GPU id: its datasheet}
    strategy: str | None = None
    utilization_given: float | None = None

    @property
    def answer(self) -> RentalAnswer:
        return required(self, RentalAnswer, "answer")

    @property
    def rows(self) -> list[GpuLayout]:
        """Each GPU's best layout."""
        return self.parts(GpuLayout, "rows")

    @property
    def layouts(self) -> list[GpuLayout]:
        return self.parts(GpuLayout, "layouts")

    @property
    def inputs(self) -> list[ProjectionInput]:
        return self.parts(ProjectionInput, "inputs")

    def check_parts(self) -> None:
        _ = self.answer, self.rows, self.layouts, self.inputs


@dataclass(frozen=True)
class PlanModelFacts(Record):
    """What the plan reads of a sizing record's `facts` (the adapted model's,
    `stages.sizing.terms.ModelFacts.to_dict`)."""

    architecture: str | None = None
    conv: dict[str, Any] | None = None  # a conv net's config (None: not one)
    num_params: int | None = None
    trainable_params: int | None = None
    layer_training: list[Any] | None = None


@dataclass(frozen=True)
class DecodingBatch(Record):
    """One generated batch of an evaluation's `decoding.batches` (`lib.probes`), in seconds
    and decoding steps."""

    prefill_s: float
    decode_s: float
    steps: int
    answer_steps: int
    prompt_tokens: float | None = None
    n: int | None = None


@dataclass(frozen=True)
class FitCandidate(Record):
    """A micro-batch the sizing's recommendation tried (`candidates`), per rank."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool
    predicted_peak_bytes: float
    fits: bool | None = None
