"""Typed pieces of a sizing record (`records/sizing/<id>.json`, `core.record_types.Sizing`),
read the way
`core.record_base.Record` reads a record: each piece checks its fields and raises the located
`StudyError` of a damaged record naming the file, the place and the field.

A piece is read from its record with `Record.part` / `Record.parts`, or with the helpers here:

| piece               | where in the sizing record               | written by                     |
|---------------------|------------------------------------------|--------------------------------|
| `SizingLengths`     | `lengths`                                | stages.sizing.lengths          |
| `SizingOptions`     | `configurations[i].options`              | stages.sizing.stage            |
| `SizingMeasured`    | `configurations[i].measured`             | stages.sizing.measure          |
| `SizingThroughput`  | `throughput`                             | stages.sizing.record           |
| `SizingRecommendation` | `recommendation`                      | stages.sizing.recommend        |
| `SizingPeak`        | `worst_batch_peak`, `evaluation_peak`    | stages.sizing.peaks            |
| `SizingEnv`         | `env`                                    | stages.sizing.record           |
| `SizingConfiguration` | `configurations[i]`                    | stages.sizing.stage            |
| `SizingPrediction`  | `configurations[i].predicted`            | stages.sizing.record           |
| `SizingRuleX4`      | `configurations[i].rule_x4`              | stages.sizing.record           |
| `SizingOtherMethod` | `recommendation.other_methods[i]`        | stages.sizing.stage            |
| `SizingWorstBatch`  | `worst_batch_peak.batch`                 | stages.sizing.peaks            |
| `SizingEvaluationSettings` | `evaluation_peak.settings`        | stages.sizing.peaks            |
| `SizingProjection`  | `projection[i]`                          | stages.sizing.stage            |
| `SizingResult`      | the measuring child's `configuration-<i>.json` | stages.sizing.measure    |
| `SizingSpec`        | the measuring child's spec, `configurations[i]` | stages.sizing.stage     |
| `MeasurePhase`      | the measuring child's `phase.json`       | stages.sizing.measure          |

The plan record's pieces are in `core.record_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core.record_base import Record, damaged
from tunelab.core.record_types import Sizing
from tunelab.core.run_parts import SizingRow

__all__ = [
    "WRITING",
    "MeasurePhase",
    "SizingConfiguration",
    "SizingEnv",
    "SizingEvaluationSettings",
    "SizingLengths",
    "SizingMeasured",
    "SizingOptions",
    "SizingOtherMethod",
    "SizingPeak",
    "SizingPrediction",
    "SizingProjection",
    "SizingRecommendation",
    "SizingResult",
    "SizingRuleX4",
    "SizingSpec",
    "SizingThroughput",
    "SizingWorstBatch",
    "configurations_of",
    "env_of",
    "lengths_of",
    "measured_of",
    "options_of",
    "peak_of",
    "projection_of",
    "recommendation_of",
    "throughput_of",
]


@dataclass(frozen=True)
class SizingLengths(Record):
    """The representative lengths a sizing measured at: the training split's token counts (or
    an image model's patch tokens or side), their quantiles and the share carrying loss."""

    source: str | None = None
    snapshot: str | None = None
    p50: float | None = None
    p95: float | None = None
    max: float | None = None
    mean: float | None = None
    quantiles: list[Any] | None = None
    loss_fraction: float | None = None
    split_counts: dict[str, Any] | None = None
    encode_train_s: float | None = None
    length_unit: str | None = None  # an image model's: "patch tokens" | "image side"
    evaluation_tokens: int | None = None
    # the encoded training examples' lengths in snapshot order: kept while sizing, not written
    order: list[int] | None = None


@dataclass(frozen=True)
class SizingOptions(Record):
    """A configuration's options: its length, micro-batch, accumulation and settings."""

    seq_len: int
    micro_batch: int
    grad_accum: int | None = None
    measured_accum: int | None = None
    precision: str | None = None
    checkpointing: bool | None = None
    packing: bool | None = None


@dataclass(frozen=True)
class SizingMeasured(Record):
    """What the measuring process found for a configuration (seconds, bytes)."""

    step_s: float | None = None
    projected_step_s: float | None = None
    micro_step_s: float | None = None
    tokens_per_s: float | None = None
    examples_per_s: float | None = None
    forward_s: float | None = None
    load_s: float | None = None
    cpu_share: float | None = None
    idle_rss: int | None = None
    idle: int | None = None  # an evaluation's idle process
    peak_total: int | None = None
    increase: int | None = None  # CPU: peak RSS less the idle RSS; CUDA: over the idle bytes
    compared: int | None = None  # what the prediction is set against (CPU increase, CUDA peak)
    cuda_major: int | None = None
    peak_rss: int | None = None
    memory_step_s: list[float] | None = None  # the memory steps' (pinned threshold)
    memory_wall_s: float | None = None
    tokens_per_step: float | None = None
    examples_per_step: int | None = None
    phase_s: dict[str, Any] | None = None  # seconds of each part: load, prime, memory_steps, ...


@dataclass(frozen=True)
class SizingThroughput(Record):
    """The step time and rate the planner uses: the study's own configuration's (`row`)."""

    row: str | None = None
    seq_len: int | None = None
    step_s: float | None = None
    micro_step_s: float | None = None
    tokens_per_s: float | None = None
    examples_per_s: float | None = None
    recommended_tokens_per_s: float | None = None


@dataclass(frozen=True)
class SizingRecommendation(Record):
    """The largest micro-batch that fits the budget at the longest length, and its figures."""

    fits: bool | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    effective_batch: int | None = None
    checkpointing: bool | None = None
    precision: str | None = None
    # predicted_peak_bytes = fixed_bytes (the idle process on CPU, 0 on CUDA) + step_peak_bytes
    predicted_peak_bytes: int | None = None
    fixed_bytes: int | None = None
    step_peak_bytes: int | None = None
    budget_bytes: int | None = None
    margin: float | None = None  # the share of the budget kept free
    calibration: float | None = None  # the largest measured / predicted ratio, at least 1
    tokens_per_s: float | None = None
    row: str | None = None  # the configuration that measured it
    reason: str | None = None  # why nothing fits
    # each method measured beside the study's (--methods): {method, fits, micro_batch,
    # grad_accum, checkpointing, predicted_peak_bytes}
    other_methods: list[Any] | None = None

    @property
    def others(self) -> list[SizingOtherMethod]:
        return self.parts(SizingOtherMethod, "other_methods")

    def check_parts(self) -> None:
        _ = self.others


@dataclass(frozen=True)
class SizingPeak(Record):
    """A step that really peaks (the worst batch, the evaluation): the settings it was found
    at, its status, and its predicted and measured bytes."""

    settings: dict[str, Any] | None = None
    status: str | None = None
    reason: str | None = None
    predicted: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None
    error_pct: float | None = None
    # the worst batch's: {step, micro_batch_index, lengths, tokens, padded_tokens, packed,
    # steps_scanned, seed}
    batch: dict[str, Any] | None = None

    @property
    def worst_batch(self) -> SizingWorstBatch | None:
        """The worst batch's step and lengths (None for the evaluation's peak)."""
        return self.part(SizingWorstBatch, "batch")

    @property
    def evaluation_settings(self) -> SizingEvaluationSettings | None:
        """The evaluation's batch (None for the worst batch, whose settings are the run's)."""
        if (self.settings or {}).get("kind") is None:
            return None
        return self.part(SizingEvaluationSettings, "settings")

    def check_parts(self) -> None:
        _ = self.worst_batch, self.evaluation_settings

    @property
    def total(self) -> int | None:
        """The bytes the budget holds: the measured whole-process figure (CPU: peak RSS; CUDA:
        max allocated), else the predicted total; None when neither is known."""
        measured = (self.measured or {}).get("peak_total")
        if self.status == "ok" and measured:
            return int(measured)
        predicted = (self.predicted or {}).get("total")
        return int(predicted) if predicted else None

    @property
    def predicted_compared(self) -> int | None:
        """The predicted bytes set against the measurement."""
        return (self.predicted or {}).get("compared")

    @property
    def measured_compared(self) -> int | None:
        """The measured bytes the prediction is set against."""
        return (self.measured or {}).get("compared")

    @property
    def idle(self) -> int:
        """The measured idle process (bytes; 0 when not measured)."""
        return int((self.measured or {}).get("idle") or 0)

    @property
    def idle_rss(self) -> int:
        """The worst batch's idle process RSS (bytes; 0 when not measured)."""
        return int((self.measured or {}).get("idle_rss") or 0)

    @property
    def scale(self) -> float:
        """measured / predicted of the figures compared, at least 1 (a prediction is never
        lowered by its measurement)."""
        measured, predicted = self.measured_compared, self.predicted_compared
        return max(1.0, measured / predicted) if measured and predicted else 1.0


@dataclass(frozen=True)
class SizingEnv(Record):
    """The machine the sizing ran on, in short."""

    torch: str | None = None
    backend: str | None = None
    cpu: dict[str, Any] | None = None
    gpus: list[Any] | None = None  # each {name, ...}
    load_avg_1m: float | None = None
    packages: dict[str, Any] | None = None

    @property
    def logical_cores(self) -> int | None:
        return (self.cpu or {}).get("logical_cores")


@dataclass(frozen=True)
class SizingPrediction(Record):
    """A configuration's predicted breakdown in bytes (`stages.sizing.memory.Estimate`) and
    the figure set against its measurement (`compared`)."""

    weights: int | None = None
    gradients: int | None = None
    optimizer_states: int | None = None
    activations: int | None = None
    logits_loss: int | None = None
    backward_temporaries: int | None = None
    peak_phase: str | None = None
    peak_total: int | None = None
    peak_increase: int | None = None
    compared: int | None = None


@dataclass(frozen=True)
class SizingRuleX4(Record):
    """What the weights x 4 rule says of a configuration, and its error against the measured."""

    bytes: int | None = None
    error_pct: float | None = None


@dataclass(frozen=True)
class SizingConfiguration(SizingRow):
    """One configuration as `tunelab size` writes it: its options, status, the measurement,
    the prediction set beside it and the x4 rule's (`SizingRow` is what a report reads of
    older records too)."""

    method: str | None = None
    traceback: str | None = None  # an attempt that raised: the child's

    @property
    def options(self) -> SizingOptions:
        return options_of(self)

    @property
    def measurement(self) -> SizingMeasured:
        """The measured figures (all None where it did not fit)."""
        return measured_of(self)

    @property
    def prediction(self) -> SizingPrediction:
        """The predicted breakdown (all None before the prediction is set beside it)."""
        return self.part(SizingPrediction, "predicted") or SizingPrediction(
            self.path, {}, where=self._at("predicted")
        )

    @property
    def rule(self) -> SizingRuleX4:
        return self.part(SizingRuleX4, "rule_x4") or SizingRuleX4(
            self.path, {}, where=self._at("rule_x4")
        )

    def check_parts(self) -> None:
        _ = self.options, self.measurement, self.prediction, self.rule


@dataclass(frozen=True)
class SizingResult(Record):
    """What the measuring child writes for a configuration (`configuration-<i>.json`,
    `memory-<i>.json`, `stages.sizing.measure`): its status, measurement and model facts."""

    label: str | None = None
    status: str | None = None
    reason: str | None = None
    traceback: str | None = None
    measured: dict[str, Any] | None = None
    facts: dict[str, Any] | None = None  # the adapted model's (ModelFacts.to_dict)
    process: dict[str, Any] | None = None  # {index, position}: which child measured it

    @property
    def measurement(self) -> SizingMeasured:
        return self.part(SizingMeasured, "measured") or SizingMeasured(
            self.path, {}, where="measured"
        )

    def check_parts(self) -> None:
        _ = self.measurement


@dataclass(frozen=True)
class SizingSpec(Record):
    """What the measuring child measures of one configuration (`configurations[i]` of its
    worker spec, written by `stages.sizing.stage`): the study's config, the shape, the budget
    and how to measure. Absent settings read as the child's defaults (`warmup_steps_or`, ...)."""

    config: dict[str, Any]  # the study's config (StudyConfig.to_dict), validated by the child
    seq_len: int
    micro_batch: int
    label: str | None = None
    root: str | None = None  # the study's folder
    labels: list[Any] | None = None
    grad_accum: int | None = None
    precision: str | None = None
    checkpointing: bool | None = None
    packing: bool | None = None
    loss_fraction: float | None = None
    warmup_steps: int | None = None
    measure_steps: int | None = None
    time_steps: int | None = None
    num_threads: int | None = None
    device: str | None = None  # auto | cpu | cuda
    memory_budget_bytes: int | None = None
    allocator: str | None = None  # pinned | default
    warmup: str | None = None  # "states" (one process for all) | "step"
    count_saved: bool | None = None
    peak: str | None = None  # a peak measured beside the configurations: worst_batch | evaluation
    lengths: list[int] | None = None  # the worst batch's, one example each
    evaluation: dict[str, Any] | None = None  # the evaluation's settings

    def steps(self) -> tuple[int, int, int]:
        """(warm-up, measured, timed) optimizer steps: the child's defaults (1, 1, 3) where
        the spec names none."""
        return (
            1 if self.warmup_steps is None else self.warmup_steps,
            1 if self.measure_steps is None else self.measure_steps,
            3 if self.time_steps is None else self.time_steps,
        )

    @property
    def pinned(self) -> bool:
        """The mmap threshold pinned (the default) rather than glibc's own."""
        return (self.allocator or "pinned") == "pinned"

    @property
    def evaluation_settings(self) -> SizingEvaluationSettings | None:
        return self.part(SizingEvaluationSettings, "evaluation")

    def check_parts(self) -> None:
        _ = self.evaluation_settings


@dataclass(frozen=True)
class MeasurePhase(Record):
    """`phase.json` of a measuring child: which configuration it is on, in which phase."""

    phase: str
    index: int


@dataclass(frozen=True)
class SizingWorstBatch(Record):
    """The run's micro-batch with the most tokens, in the trainer's seeded order
    (`stages.sizing.peaks.find_worst_batch`)."""

    lengths: list[int]
    packed: bool
    step: int | None = None  # 1-based
    micro_batch_index: int | None = None
    tokens: int | None = None
    padded_tokens: int | None = None
    steps_scanned: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SizingEvaluationSettings(Record):
    """What `tunelab eval` runs at its worst batch (`stages.sizing.peaks.evaluation_settings`)."""

    kind: str
    batch_size: int
    tokens: int
    max_new_tokens: int = 0


@dataclass(frozen=True)
class SizingOtherMethod(Record):
    """A method measured beside the study's (`--methods`): its own recommendation."""

    method: str | None = None
    fits: bool | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    checkpointing: bool | None = None
    predicted_peak_bytes: int | None = None


@dataclass(frozen=True)
class SizingProjection(Record):
    """The analytic per-rank peak over `ranks` processes under DDP and FSDP."""

    ranks: int
    micro_batch: int
    grad_accum: int
    ddp: int
    fsdp: int


# where a piece of a sizing `tunelab size` is still building is checked: no file holds it yet
WRITING = Path("records/sizing (being written)")


def configurations_of(sizing: Sizing) -> list[SizingConfiguration]:
    """The configurations measured, each with its options, measurement and prediction."""
    return sizing.parts(SizingConfiguration, "configurations")


def projection_of(sizing: Sizing) -> list[SizingProjection]:
    return sizing.parts(SizingProjection, "projection")


def lengths_of(sizing: Sizing) -> SizingLengths:
    """The record's lengths (all None where it has none: `--seq-len`)."""
    return sizing.part(SizingLengths, "lengths") or SizingLengths(sizing.path, {}, where="lengths")


def throughput_of(sizing: Sizing) -> SizingThroughput:
    return sizing.part(SizingThroughput, "throughput") or SizingThroughput(
        sizing.path, {}, where="throughput"
    )


def recommendation_of(sizing: Sizing) -> SizingRecommendation:
    return sizing.part(SizingRecommendation, "recommendation") or SizingRecommendation(
        sizing.path, {}, where="recommendation"
    )


def env_of(sizing: Sizing) -> SizingEnv:
    return sizing.part(SizingEnv, "env") or SizingEnv(sizing.path, {}, where="env")


def peak_of(sizing: Sizing, name: str) -> SizingPeak | None:
    """`worst_batch_peak` or `evaluation_peak` (None where the sizing measured none)."""
    return sizing.part(SizingPeak, name)


def options_of(row: Record) -> SizingOptions:
    """A configuration row's options."""
    found = row.part(SizingOptions, "options")
    if found is None:
        raise damaged(row.path, f"{row.where}: field 'options' is missing")
    return found


def measured_of(row: Record) -> SizingMeasured:
    """A configuration row's measurement (all None where it has none: it did not fit)."""
    return row.part(SizingMeasured, "measured") or SizingMeasured(
        row.path, {}, where=f"{row.where}.measured"
    )
