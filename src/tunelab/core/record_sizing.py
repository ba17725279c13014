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

The plan record's pieces are in `core.record_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.core.record_base import Record, damaged
from tunelab.core.record_types import Sizing

__all__ = [
    "SizingEnv",
    "SizingLengths",
    "SizingMeasured",
    "SizingOptions",
    "SizingPeak",
    "SizingRecommendation",
    "SizingThroughput",
    "env_of",
    "lengths_of",
    "measured_of",
    "options_of",
    "peak_of",
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
    peak_total: int | None = None
    cuda_major: int | None = None


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

    @property
    def logical_cores(self) -> int | None:
        return (self.cpu or {}).get("logical_cores")


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
