"""Typed record kinds: one class per kind of evidence, read back with one located error.

Each class names the fields the stages read, with their types; `raw` keeps the whole record so a
field no class names yet stays readable (and the report can show a record as written).
`Kind.read(path)` is the one way to read a record back:

- a missing file or a file that is not JSON raises `StudyError` naming the path (and the line),
  from `records.read_json`;
- a record that is not a JSON object, or lacks a field its kind always has, or has it with the
  wrong type, raises `StudyError` naming the path and the field: "the record is damaged".

The writers stay with their stages (a record is written once, where its facts are known); a
class here is what every other stage reads it back as.

| kind           | file                                   | written by                  |
|----------------|----------------------------------------|-----------------------------|
| `RunConfig`    | runs/<run>/config.json                 | core.study.Study.create_run |
| `RunStatus`    | runs/<run>/status.json                 | core.study.Run.set_status   |
| `Evaluation`   | runs/<run>/metrics-<split>.json        | stages.evaluate             |
| `Smoke`        | runs/<run>/smoke.json                  | stages.smoke                |
| `Verify`       | runs/<run>/verify-<n>.json             | stages.verify               |
| `Sizing`       | sizing/size-<stamp>.json               | stages.sizing               |
| `Plan`         | plans/plan-<stamp>.json                | stages.plan                 |
| `Compare`      | compare/<id>.json                      | stages.compare              |
| `ExportManifest` | exports/<id>/tunelab-manifest.json   | stages.export               |

Kinds with a module of their own (and the pieces nested in them):

| kind              | file                                  | module            | written by       |
|-------------------|---------------------------------------|-------------------|------------------|
| `DataManifest`    | data/<snapshot>/manifest.json         | core.record_data  | stages.data      |
| `Duplicates`      | data/<snapshot>/duplicates.json       | core.record_data  | stages.data      |
| `Inspection`      | inspect/<id>.json                     | core.record_inspect | stages.inspect |
| `RunEnv`          | runs/<run>/env.json                   | core.run_parts    | core.study       |
| `ParameterAudit`  | runs/<run>/audit.json                 | core.run_parts    | stages.train     |
| `TrainStep`       | runs/<run>/metrics.jsonl (one a line) | core.run_parts    | stages.train     |
| `PlatformGate`    | runs/<run>/platforms.jsonl (a line)   | core.run_parts    | stages.train     |

The fresh process's messages, a run's compute.json and a tracker's sync are in
core.record_checks; the export manifest's pieces are in core.record_export; the plan's
durations and phases (`PlanSchedule`) in core.record_plan; the sizing record's pieces in core.record_sizing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tunelab.core.record_base import Record, damaged, mapping_of
from tunelab.core.record_export import (
    ExportArtifact,
    ExportBase,
    ExportEnvironment,
    ExportGuardrails,
    ExportHypothesis,
    ExportResults,
    ExportTask,
    LimitationsDetail,
    MergeCheck,
)
from tunelab.core.record_parts import (
    AdaptationSettings,
    CategoryMetrics,
    CheckpointCheck,
    CompareBaseline,
    CompareEntry,
    ConfigChange,
    Confusion,
    Decoding,
    EnvironmentCheck,
    FieldMetrics,
    FreshTimings,
    GuardrailRule,
    LockedTests,
    ModelIdentity,
    Pin,
    Reproduced,
    SizingRow,
)
from tunelab.core.run_parts import EvalCopy, LockedSpec, PlatformGate, TrainingSettings

if TYPE_CHECKING:
    from tunelab.core.config import StudyConfig

__all__ = [
    "Compare",
    "Evaluation",
    "ExportManifest",
    "Hypothesis",
    "Plan",
    "Record",
    "RunConfig",
    "RunStatus",
    "Sizing",
    "Smoke",
    "Verify",
    "damaged",
]


@dataclass(frozen=True)
class RunConfig(Record):
    """runs/<run>/config.json: what a run was started with (`Run.record`; `Run.config` is its
    study config validated once)."""

    run_id: str = ""
    kind: str = ""
    name: str | None = None
    parent: str | None = None
    overrides: list[str] | None = None
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    config_sha256: str = ""
    data_snapshot: str | None = None
    hypothesis_version: int | None = None
    hypothesis_sha256: str | None = None
    base_model: dict[str, Any] | None = None
    labels: list[str] | None = None
    why: str | None = None
    split: str | None = None  # an evaluation run's split
    evaluates: str | None = None  # an eval run: the run it evaluates
    evaluation_spec_sha256: str | None = None  # an evaluation run: the locked spec it used
    hypothesis_evaluation_spec_sha256: str | None = None  # a smoke or training run's
    platform_gate: dict[str, Any] | None = None  # a training run's: see `gate`

    @property
    def gate(self) -> PlatformGate | None:
        """What the platform gate found when the run started (None: a run it does not gate)."""
        return self.part(PlatformGate, "platform_gate")

    def check_parts(self) -> None:
        if (gate := self.gate) is not None:
            gate.check_parts()

    @property
    def base(self) -> ModelIdentity:
        """The base model's identity as recorded (empty when the run names none)."""
        return self.part(ModelIdentity, "base_model") or ModelIdentity(
            self.path, {}, where="base_model"
        )

    def study_config(self) -> StudyConfig:
        """The saved study config, validated (a ConfigError names this file)."""
        from tunelab.core.config import validate_config

        return validate_config(self.config, source=str(self.path))

    @property
    def adaptation(self) -> AdaptationSettings:
        """The saved `adaptation` section (no validation: cheap, for display)."""
        return AdaptationSettings.of(
            self.path, self.config.get("adaptation") or {}, "config.adaptation"
        )

    @property
    def training(self) -> TrainingSettings:
        """The saved `training` section as written (no validation: cheap, for display)."""
        return TrainingSettings.of(self.path, self.config.get("training") or {}, "config.training")


@dataclass(frozen=True)
class RunStatus(Record):
    """runs/<run>/status.json: the run's last status, replaced at each change; a training run's
    final one adds its summary (steps, losses, seconds, rate, final checkpoint)."""

    # the fields every status has; the others are a training run's summary
    COMMON: ClassVar = ("run_id", "status", "reason", "at")

    run_id: str = ""
    status: str = ""
    reason: str | None = None
    at: str | None = None
    steps: int | None = None
    final_loss: float | None = None
    val_loss_initial: float | None = None
    val_loss: float | None = None
    train_seconds: float | None = None
    tokens_per_s: float | None = None
    final_checkpoint: str | None = None
    update_check: dict[str, Any] | None = None  # core.record_smoke.UpdateCheck

    def summary(self) -> dict[str, Any]:
        """What the status adds to the common fields, as written (the `--json` summary)."""
        return {k: v for k, v in self.raw.items() if k not in self.COMMON}


@dataclass(frozen=True)
class Evaluation(Record):
    """runs/<run>/metrics-<split>.json: one evaluation of a model on one split."""

    split: str = ""
    n: int = 0
    task_kind: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    seconds: float | None = None
    labels: list[str] | None = None
    fields: list[str] | None = None
    spec_sha256: str | None = None
    template_sha256: str | None = None  # the prompt template (or image chain) it encoded with
    run_id: str | None = None
    generation: dict[str, Any] | None = None
    cpu_share: float | None = None
    load_s: float | None = None  # the model's load, before the first example
    examples_per_s: float | None = None
    torch_threads: int | None = None
    evaluation: dict[str, Any] | None = None  # the evaluation settings it ran with
    merge: dict[str, Any] | None = None  # whether it ran on a merged copy, and why
    evaluates: str | None = None  # an eval run's parent: the run evaluated
    test_openings: int | None = None  # a test evaluation: the split's openings so far
    warning: str | None = None
    data_snapshot: str | None = None
    hypothesis_version: int | None = None
    template_sha256: str | None = None  # a generative evaluation's prompt template

    @property
    def per_category(self) -> dict[str, CategoryMetrics]:
        return mapping_of(
            CategoryMetrics, self.path, self.metrics.get("per_category"), "metrics.per_category"
        )

    @property
    def per_field(self) -> dict[str, FieldMetrics]:
        return mapping_of(
            FieldMetrics, self.path, self.metrics.get("per_field"), "metrics.per_field"
        )

    @property
    def confusion(self) -> Confusion | None:
        raw = self.metrics.get("confusion")
        return None if raw is None else Confusion.of(self.path, raw, "metrics.confusion")

    @property
    def failure_counts(self) -> dict[str, int]:
        return dict(self.metrics.get("failure_counts") or {})

    @property
    def max_new_tokens(self) -> int | None:
        """The generation budget it ran with (None for a classifier's)."""
        return (self.evaluation or {}).get("max_new_tokens")

    @property
    def decoding(self) -> Decoding | None:
        """The decoding of a generative evaluation (None for a classifier's)."""
        return self.part(Decoding, "generation")

    @property
    def scoring(self) -> str | None:
        """The scorer that judged an extraction's predictions (None: an earlier one)."""
        return self.metrics.get("scoring")

    @property
    def eval_copy(self) -> EvalCopy | None:
        """Whether it ran on its evaluation copy (None: a record before the copy existed)."""
        return self.part(EvalCopy, "merge")

    def check_parts(self) -> None:
        _ = self.per_category, self.per_field, self.confusion, self.decoding, self.eval_copy


@dataclass(frozen=True)
class Smoke(Record):
    """runs/<run>/smoke.json: the smoke test's checks (`{check, ok, detail}`), verdict and
    timings (seconds; None when the smoke stopped before measuring one)."""

    passed: bool = False
    reason: str | None = None
    hint: str | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)
    step_s: float | None = None
    first_step_s: float | None = None
    tokens_per_step: float | None = None
    eval_s_per_example: float | None = None
    fresh_process_s: float | None = None
    fresh_eval_s: float | None = None
    fresh_checks_s: float | None = None
    checkpoint_save_s: float | None = None
    reload_s: float | None = None
    total_s: float | None = None
    adapter_timing: dict[str, Any] | None = None
    adapter_time_ratio: float | None = None

    def numbers(self) -> dict[str, float]:
        """Every number at the record's top (its timings and counts), by name."""
        return {
            k: v
            for k, v in self.raw.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }


@dataclass(frozen=True)
class Verify(Record):
    """runs/<run>/verify-<n>.json: one verification of a run's checkpoint."""

    record: str | None = None  # its own file name, as written
    passed: bool = False
    reason: str | None = None
    finished_at: str | None = None
    environment: dict[str, Any] | None = None  # {same, message, ...}: against the run's
    run_id: str | None = None  # the run verified
    model_run: str | None = None  # the run whose checkpoint was reloaded (an eval's parent)
    model_kind: str | None = None
    evaluation_run: str | None = None  # the run whose recorded predictions were reproduced
    split: str | None = None
    checkpoint: dict[str, Any] | None = None  # {ok, files_checked, changed, missing}
    predictions: dict[str, Any] | None = None  # {matched, n, atol, max_score_diff, mismatches}
    timings: dict[str, Any] | None = None  # {load_s, eval_s, ...}
    seconds: float | None = None  # how long the verification took

    @property
    def checkpoint_check(self) -> CheckpointCheck | None:
        return self.part(CheckpointCheck, "checkpoint")

    @property
    def reproduced(self) -> Reproduced | None:
        return self.part(Reproduced, "predictions")

    @property
    def environment_check(self) -> EnvironmentCheck | None:
        return self.part(EnvironmentCheck, "environment")

    @property
    def fresh_timings(self) -> FreshTimings | None:
        return self.part(FreshTimings, "timings")

    def check_parts(self) -> None:
        _ = self.checkpoint_check, self.fresh_timings
        if (env := self.environment_check) is not None:
            _ = env.differences
        if (reproduced := self.reproduced) is not None:
            _ = reproduced.mismatches


@dataclass(frozen=True)
class Sizing(Record):
    """sizing/size-<stamp>.json: the measured step, memory and lengths on one device."""

    id: str = ""
    device: str = ""
    seconds: float | None = None
    lengths: dict[str, Any] | None = None
    env: dict[str, Any] | None = None
    facts: dict[str, Any] | None = None  # the adapted model's (ModelFacts.to_dict)
    throughput: dict[str, Any] | None = None  # the study's own configuration: {row, step_s, ...}
    configurations: list[dict[str, Any]] | None = None  # one row per configuration measured
    model: dict[str, Any] | None = None  # {architecture, ...} of the model sized
    recommendation: dict[str, Any] | None = None  # micro-batch, accumulation, predicted peak
    hypothesis_version: int | None = None
    memory_budget_bytes: int | None = None  # the budget every figure was measured against
    # the run's worst micro-batch in its seeded order: {batch {step, lengths, ...}, settings,
    # status, case, predicted {compared, total, ...}, measured {compared, peak_total, ...},
    # error_pct} (tunelab.stages.sizing.peaks)
    worst_batch_peak: dict[str, Any] | None = None
    # `tunelab eval`'s worst batch: {settings {kind, batch_size, tokens, max_new_tokens},
    # status, predicted, measured, error_pct}
    evaluation_peak: dict[str, Any] | None = None
    max_error_pct: float | None = None
    rule_x4_max_error_pct: float | None = None
    allocator: str | None = None
    projection: list[Any] | None = None  # [{ranks, micro_batch, grad_accum, ddp, fsdp}]
    load: list[Any] | None = None  # the load before the first step, each layout (sizing.load)

    @property
    def rows(self) -> list[SizingRow]:
        """The configurations measured (`rows` in records before that name)."""
        name = "configurations" if "configurations" in self.raw else "rows"
        return self.parts(SizingRow, name)

    @property
    def length_unit(self) -> str | None:
        """tokens, or an image model's unit (image side, patch tokens)."""
        return (self.lengths or {}).get("length_unit")

    @property
    def architecture(self) -> str | None:
        return (self.model or {}).get("architecture")


@dataclass(frozen=True)
class PlanCost(Record):
    """A plan's busy and rented GPU-hours, and their cost in the price's currency."""

    busy_hours: float | None = None
    busy_cost: float | None = None
    rental_hours: float | None = None
    rental_cost: float | None = None


@dataclass(frozen=True)
class Plan(Record):
    """plans/plan-<stamp>.json: a rental plan and the figures it was built from."""

    id: str = ""
    created_ns: int | None = None
    config_sha256: str | None = None
    days: float | None = None  # the rental window
    hours_per_day: float | None = None  # the rental's working hours a day
    device: str | None = None  # the device the figures were measured on (older plans)
    gpu: str | None = None  # the rented GPU, as its catalog names it
    gpu_hour_price: float | None = None
    num_variants: int | None = None  # the variants the study registers
    variants_that_fit: int | None = None
    warnings: list[str] | None = None
    gantt_png: str | None = None  # the chart of the phases

    @property
    def cost(self) -> PlanCost:
        return self.part(PlanCost, "cost") or PlanCost(self.path, {}, where="cost")

    def check_parts(self) -> None:
        _ = self.cost


@dataclass(frozen=True)
class Compare(Record):
    """compare/<id>.json: variants set against the baseline on one split (`baseline`, and one
    `CompareEntry` per run in `runs`: see core/record_parts)."""

    id: str | None = None
    split: str | None = None
    created_at: str | None = None
    task_kind: str | None = None
    primary_metric: str | None = None
    min_improvement: float | None = None
    decision: str | None = None  # adopt | reject | inconclusive: the study's
    test_openings: int | None = None
    warnings: list[str] | None = None
    bootstrap: dict[str, Any] | None = None  # {samples, seed, confidence}
    hypothesis_version: int | None = None

    @property
    def baseline(self) -> CompareBaseline | None:
        return self.part(CompareBaseline, "baseline")

    @property
    def tests(self) -> LockedTests:
        return self.part(LockedTests, "tests") or LockedTests(self.path, {}, where="tests")

    @property
    def runs(self) -> list[CompareEntry]:
        return self.parts(CompareEntry, "runs")

    def check_parts(self) -> None:
        _ = self.baseline, self.tests
        for entry in self.runs:
            entry.check_parts()

    def lists(self, run_id: str) -> bool:
        """Whether this comparison holds `run_id`, as its baseline or as one of its rows."""
        base = self.baseline
        return (base is not None and base.run_id == run_id) or any(
            r.run_id == run_id for r in self.runs
        )


@dataclass(frozen=True)
class ExportManifest(Record):
    """exports/<id>/tunelab-manifest.json: what an export holds and where it came from."""

    run_id: str | None = None
    created_at: str | None = None
    artifact: dict[str, Any] | None = None  # what the folder holds at its top: {kind, method, ...}
    base: dict[str, Any] | None = None  # the base model's identity (name, sha256, hub, path)
    results: dict[str, Any] | None = None  # the comparison with the baseline: {primary, ...}
    guardrails: dict[str, Any] | None = None  # {pass: true | false | None, ...}
    merge: dict[str, Any] | None = None  # a merged export's check against the adapter
    config: dict[str, Any] | None = None
    config_sha256: str | None = None
    files: dict[str, Any] | None = None
    limitations: list[Any] | None = None
    hypothesis: dict[str, Any] | None = None  # the exported run's {version, sha256}
    format: str | None = None
    created_at: str | None = None
    tunelab_version: str | None = None
    study: str | None = None
    tokenizer_dir: str | None = None
    adaptation: dict[str, Any] | None = None  # the run's adaptation section, as the card says it
    training: dict[str, Any] | None = None
    data_snapshot: str | None = None
    example: str | None = None  # example.json (None without a validation prediction)
    manifest_sha256: str | None = None

    @property
    def identity(self) -> ModelIdentity:
        """The base model the export is bound to."""
        return self.part(ModelIdentity, "base") or ModelIdentity(self.path, {}, where="base")

    @property
    def bound_base(self) -> ExportBase:
        """The base as the export names it (its hub commit, its folder at export)."""
        return self.part(ExportBase, "base") or ExportBase(self.path, {}, where="base")

    @property
    def contents(self) -> ExportArtifact | None:
        """What the folder holds (the manifest's `artifact`)."""
        return self.part(ExportArtifact, "artifact")

    @property
    def comparison(self) -> ExportResults | None:
        """The exported run against the baseline (the manifest's `results`)."""
        return self.part(ExportResults, "results")

    @property
    def adaptation_settings(self) -> AdaptationSettings:
        """The `adaptation` section of the run's saved config (what its adapter must match)."""
        section = (self.config or {}).get("adaptation") or {}
        return AdaptationSettings.of(self.path, section, "config.adaptation")

    @property
    def task(self) -> ExportTask:
        return self.part(ExportTask, "task") or ExportTask(self.path, {}, where="task")

    @property
    def tested(self) -> ExportHypothesis:
        """The hypothesis the run tested (the manifest's `hypothesis`)."""
        found = self.part(ExportHypothesis, "hypothesis")
        return found or ExportHypothesis(self.path, {}, where="hypothesis")

    @property
    def environment(self) -> ExportEnvironment:
        found = self.part(ExportEnvironment, "environment")
        return found or ExportEnvironment(self.path, {}, where="environment")

    @property
    def detail(self) -> LimitationsDetail:
        """The limitations as data (the manifest's `limitations_detail`)."""
        found = self.part(LimitationsDetail, "limitations_detail")
        return found or LimitationsDetail(self.path, {}, where="limitations_detail")

    @property
    def guardrail_check(self) -> ExportGuardrails | None:
        return self.part(ExportGuardrails, "guardrails")

    @property
    def merge_check(self) -> MergeCheck | None:
        return self.part(MergeCheck, "merge")

    def check_parts(self) -> None:
        _ = self.identity, self.bound_base, self.contents, self.guardrail_check
        _ = self.merge_check, self.task, self.tested, self.environment, self.detail

    @property
    def hypothesis_version(self) -> int | None:
        return (self.hypothesis or {}).get("version")


@dataclass(frozen=True)
class Hypothesis(Record):
    """records/hypothesis-v<N>.json: a locked hypothesis (`content`, hashed by `sha256`) and
    what it amends (`diff`: [{path, old, new}]). Read by `core.evidence.read_hypothesis`, which
    also checks the hash."""

    version: int = 0
    sha256: str = ""
    registered_at: str | None = None
    evaluation_spec_sha256: str | None = None
    content: dict[str, Any] = field(default_factory=dict, repr=False)
    diff: list[dict[str, Any]] | None = None

    @property
    def statement(self) -> dict[str, Any]:
        """The `hypothesis` section as locked: behaviour, metric, minimum improvement, ..."""
        return dict(self.content.get("hypothesis") or {})

    @property
    def guardrails(self) -> list[GuardrailRule]:
        rules = self.content.get("guardrails") or []
        return [
            GuardrailRule.of(self.path, rule, f"content.guardrails[{i}]")
            for i, rule in enumerate(rules)
        ]

    @property
    def pins(self) -> dict[str, Pin]:
        return mapping_of(Pin, self.path, self.content.get("pins"), "content.pins")

    @property
    def changes(self) -> list[ConfigChange]:
        """What this version changed against the one before ([] for the first)."""
        return self.parts(ConfigChange, "diff")

    @property
    def locked(self) -> LockedSpec:
        """The content as the comparison reads it: claim, guardrails, evaluation spec."""
        return LockedSpec.of(self.path, self.content, "content")

    def check_parts(self) -> None:
        _ = self.guardrails, self.pins, self.changes
