"""The typed pieces nested in a run's records: its environment (env.json), an evaluation's
per-category and per-field figures, confusion matrix and decoding, a verification's checks,
a sizing's rows, the base model's identity, and a locked hypothesis's guardrail rules and
pins. Each is a `Record` read at a place inside its record file (`where`), so a damaged piece
raises the located `StudyError` (see core/record_base). `core/record_parts` re-exports them
beside a comparison's pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tunelab.core.record_base import (
    Record,
    as_written,
)

__all__ = [
    "AdaptationSettings",
    "EnvDifference",
    "EvalCopy",
    "TrainingSettings",
    "CategoryMetrics",
    "CheckpointCheck",
    "Confusion",
    "Decoding",
    "EnvironmentCheck",
    "FieldMetrics",
    "FreshTimings",
    "GateOverride",
    "Gpu",
    "GuardrailRule",
    "HypothesisClaim",
    "LockedEvaluation",
    "LockedSpec",
    "Mismatch",
    "ModelIdentity",
    "ParamCount",
    "ParamTotals",
    "ParameterAudit",
    "Pin",
    "PlatformGate",
    "PowerEstimate",
    "Prediction",
    "Reproduced",
    "RunDistributed",
    "RunEnv",
    "SizingRow",
    "TrainStep",
]


@dataclass(frozen=True)
class Gpu(Record):
    """One GPU an environment saw."""

    name: str | None = None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class RunDistributed(Record):
    """env.json's `distributed`: what torch.distributed offers here, and for a run started
    under a strategy (stages.train.parallel) its name, world size, backend and ranks."""

    available: bool | None = None
    gloo: bool | None = None
    nccl: bool | None = None
    strategy: str | None = None  # None: a single process
    world_size: int | None = None
    backend: str | None = None
    backend_version: dict[str, Any] | None = None  # {library, version}
    ranks: list[dict[str, Any]] | None = None  # {rank, local_rank, device, host, pid}


@dataclass(frozen=True)
class RunEnv(Record):
    """runs/<run>/env.json: where a run computed (core.env.environment)."""

    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    driver: str | None = None
    gpus: list[dict[str, Any]] | None = None
    cpu: dict[str, Any] | None = None
    packages: dict[str, str] | None = None
    compute_device: str | None = None
    backend: str | None = None
    tunelab_git: dict[str, Any] | None = None
    os: dict[str, Any] | None = None
    rocm: str | None = None
    cudnn: str | int | None = None
    nccl: str | int | list[int] | None = None
    attention: dict[str, bool] | None = None  # kernel -> available here
    bf16_supported: bool | None = None
    implementation: str | None = None  # CPython, PyPy, ...
    rccl: str | None = None
    extensions: dict[str, str | None] | None = None  # optional kernels installed: version
    distributed: dict[str, Any] | None = None  # see `parallel`

    @property
    def computed_on(self) -> str | None:
        """Where it computed (a record without `compute_device` computed where its backend
        was)."""
        return self.raw.get("compute_device", self.backend)

    @property
    def parallel(self) -> RunDistributed:
        """torch.distributed here, and the strategy a run was started with."""
        return self.part(RunDistributed, "distributed") or RunDistributed(
            self.path, {}, where="distributed"
        )

    def package(self, name: str) -> str | None:
        """The version of package `name` it ran (None: not installed or not recorded)."""
        return (self.packages or {}).get(name)

    @property
    def device_names(self) -> list[str]:
        """Its GPUs' names, else its CPU's name: one string each."""
        if self.gpus:
            return [str(g.name) for g in self.devices]
        return [str((self.cpu or {}).get("name"))]

    @property
    def devices(self) -> list[Gpu]:
        """The GPUs it saw ([] on a CPU)."""
        return self.parts(Gpu, "gpus")

    @property
    def logical_cores(self) -> int | None:
        return (self.cpu or {}).get("logical_cores")

    @property
    def git_commit(self) -> str | None:
        """The commit of the tunelab checkout it ran (None for an installed package)."""
        return (self.tunelab_git or {}).get("commit")

    @property
    def cpu_name(self) -> str | None:
        return (self.cpu or {}).get("name")

    @property
    def device_text(self) -> str | None:
        """Its GPUs' names, else its CPU's name."""
        return ", ".join(g.name or "" for g in self.devices) or (self.cpu or {}).get("name")

    @property
    def cpu_text(self) -> str:
        """The CPU's name and its logical cores."""
        cpu = self.cpu or {}
        return f"{cpu.get('name')} ({cpu.get('logical_cores')} cores)"

    def check_parts(self) -> None:
        _ = self.devices, self.parallel


@dataclass(frozen=True)
class ModelIdentity(Record):
    """A base model's identity as a record names it (lib.models.identity.model_identity)."""

    RENAMED: ClassVar = {"path": "location"}

    name: str | None = None
    revision: str | None = None
    location: str | None = None  # the folder it was read from
    sha256: str | None = None
    architecture: str | None = None
    files: dict[str, str] | None = None  # file name -> sha256
    source: dict[str, Any] | None = None  # {hub: {repo_id, revision, commit}} | {gguf_sha256}

    @property
    def hub(self) -> dict[str, Any]:
        """The hub commit the base is pinned to ({} for a local base)."""
        return (self.source or {}).get("hub") or {}

    @property
    def hub_pin(self) -> Pin:
        """The hub repository and commit the base is pinned to (empty for a local base)."""
        return Pin.of(self.path, self.hub, self._at("source.hub"))


@dataclass(frozen=True)
class CategoryMetrics(Record):
    """One category's figures in an evaluation (classification)."""

    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    support: int | None = None


@dataclass(frozen=True)
class FieldMetrics(Record):
    """One field path's figures in an evaluation (extraction): rates over its `slots`."""

    presence_rate: float | None = None
    exact_match: float | None = None
    normalized_match: float | None = None
    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    slots: int | None = None
    kind: str | None = None  # value | object | list: what the schema path holds
    failures: dict[str, int] | None = None  # failed slots by kind (missing, wrong_type, ...)


@dataclass(frozen=True)
class Confusion(Record):
    """A confusion matrix: rows the gold `labels`, columns the `predicted` labels (a label the
    model answered outside the list included)."""

    labels: list[str] = field(default_factory=list)
    predicted: list[str] = field(default_factory=list)
    matrix: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Decoding(Record):
    """How a generative evaluation decoded: batches, steps, and answers over the budget."""

    steps: int | None = None
    batches: list[Any] | None = None
    answer_steps: int | None = None
    s_per_step: float | None = None
    answers_over_budget: int | None = None


@dataclass(frozen=True)
class CheckpointCheck(Record):
    """A checkpoint's files against the sha256 its run recorded (stages.train.checkpoint
    .check_checkpoint_files): `damaged_files` maps a file to why it cannot be loaded."""

    RENAMED: ClassVar = {"path": "location", "damaged": "damaged_files"}

    ok: bool | None = None
    files_checked: int | None = None
    changed: list[str] | None = None
    missing: list[str] | None = None
    location: str | None = None  # the checkpoint's folder
    damaged_files: dict[str, str] | None = None


@dataclass(frozen=True)
class Mismatch(Record):
    """One recorded prediction a fresh process did not reproduce (`recorded`, `fresh`: the
    values as written)."""

    RENAMED: ClassVar = {"field": "what"}

    id: str | int = ""
    what: str | None = None  # the field of the prediction that differs

    recorded = as_written("recorded")
    fresh = as_written("fresh")


@dataclass(frozen=True)
class Reproduced(Record):
    """How many recorded predictions a fresh process reproduced, within `atol`."""

    matched: int | None = None
    n: int | None = None
    atol: float | None = None
    max_score_diff: float | None = None
    mismatched: int | None = None  # examples not reproduced
    missing: list[Any] | None = None  # ids the fresh process did not answer (the first few)
    ok: bool | None = None

    @property
    def mismatches(self) -> list[Mismatch]:
        return self.parts(Mismatch, "mismatches")


@dataclass(frozen=True)
class EnvDifference(Record):
    """One field of the environment that differs from the run's env.json (`recorded` and
    `current`, as written)."""

    RENAMED: ClassVar = {"field": "what"}

    what: str = ""

    recorded = as_written("recorded")
    current = as_written("current")


@dataclass(frozen=True)
class EnvironmentCheck(Record):
    """This process's environment against the run's."""

    same: bool | None = None
    message: str | None = None
    platform: dict[str, Any] | None = None  # core.env.platform_of this process's environment

    @property
    def differences(self) -> list[EnvDifference]:
        return self.parts(EnvDifference, "differences")


@dataclass(frozen=True)
class FreshTimings(Record):
    """Seconds a fresh process took to load the checkpoint and to evaluate."""

    load_s: float | None = None
    eval_s: float | None = None


@dataclass(frozen=True)
class SizingRow(Record):
    """One configuration a sizing measured: its options, the predicted and measured peak
    (MiB) and step time (records before the flat figures hold them in `predicted` and
    `measured`)."""

    label: str | None = None
    name: str | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    predicted_mb: float | None = None
    measured_mb: float | None = None
    error_pct: float | None = None
    step_s: float | None = None
    status: str | None = None
    reason: str | None = None
    predicted: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None

    @property
    def title(self) -> Any:
        """The row's label, else its name, else its options as written."""
        return self.label or self.name or self.raw.get("options")

    @property
    def predicted_peak_mb(self) -> float | None:
        return self.predicted_mb or (self.predicted or {}).get("total_mb")

    @property
    def measured_peak_mb(self) -> float | None:
        return self.measured_mb or (self.measured or {}).get("peak_mb")

    @property
    def measured_step_s(self) -> float | None:
        return self.step_s or (self.measured or {}).get("step_s")


@dataclass(frozen=True)
class TrainingSettings(Record):
    """The `training` section of a run's saved config, as written (no validation: a config
    saved before a setting existed reads it as None)."""

    seed: int | None = None
    precision: str | None = None
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None
    activation_checkpointing: bool | None = None
    num_threads: int | None = None


@dataclass(frozen=True)
class EvalCopy(Record):
    """An evaluation's `merge`: whether it ran on its evaluation copy (merged, or with packed
    linear layers), why, and what the copy and its check took (lib.inference.eval_copy)."""

    merged: bool | None = None
    copy: bool | None = None
    reason: str | None = None
    merge_s: float | None = None
    check_s: float | None = None
    packed: dict[str, Any] | None = None  # {linears, kernel} or {linears: 0, reason}

    @property
    def on_copy(self) -> bool:
        """Whether it ran on the copy (a record without `copy` had one only when merged)."""
        return bool(self.raw.get("copy", self.merged))


@dataclass(frozen=True)
class AdaptationSettings(Record):
    """The `adaptation` section of a run's saved config, as the dossier names the method."""

    method: str | None = None
    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | str | None = None
    quantization: dict[str, Any] | None = None

    @property
    def quant_type(self) -> str:
        """QLoRA's 4-bit type (nf4 when the config names none)."""
        return (self.quantization or {}).get("quant_type", "nf4")


@dataclass(frozen=True)
class GuardrailRule(Record):
    """One guardrail as a hypothesis locked it: what must not get worse, and by how much."""

    metric: str | None = None
    scope: str | None = None
    op: str | None = None
    value: float | None = None
    relative_to: str | None = None  # "baseline", or None for an absolute bound
    test: str | None = None  # interval | point (None: locked before it, an interval)


@dataclass(frozen=True)
class HypothesisClaim(Record):
    """The `hypothesis` section as locked: the primary metric, the smallest improvement that
    counts, and the goal (superiority, or equivalence within a margin)."""

    primary_metric: str = ""
    min_improvement: float | None = None
    goal: str | None = None
    equivalence_margin: float | None = None


@dataclass(frozen=True)
class LockedEvaluation(Record):
    """The decision's test settings in a locked evaluation spec (None: locked before they
    existed, read as the documented defaults)."""

    confidence: float | None = None
    interval_method: str | None = None
    multiplicity: str | None = None


@dataclass(frozen=True)
class LockedSpec(Record):
    """A locked hypothesis's `content`: the claim, the guardrails (as written, for the
    comparison), and the evaluation spec (its `task` validated by core.config_sections)."""

    guardrails: list[dict[str, Any]] | None = None
    evaluation_spec: dict[str, Any] | None = None

    @property
    def claim(self) -> HypothesisClaim:
        return self.part(HypothesisClaim, "hypothesis") or HypothesisClaim.of(
            self.path, {}, self._at("hypothesis")
        )

    @property
    def tests(self) -> LockedEvaluation:
        spec = self.evaluation_spec or {}
        return LockedEvaluation.of(
            self.path, spec.get("evaluation") or {}, self._at("evaluation_spec.evaluation")
        )

    @property
    def task(self) -> Any:
        """The evaluation spec's `task` section as locked."""
        return (self.evaluation_spec or {}).get("task")

    def check_parts(self) -> None:
        _ = self.claim, self.tests


@dataclass(frozen=True)
class Pin(Record):
    """A hub repository a hypothesis pinned: what a revision meant when it was locked."""

    repo_id: str | None = None
    repo_type: str | None = None
    revision: str | None = None
    commit: str | None = None


@dataclass(frozen=True)
class ParamCount(Record):
    """Parameters of a module group (or a dtype's bytes): trainable and frozen."""

    trainable: int = 0
    frozen: int = 0
    tensors_trainable: int | None = None  # a group's trainable tensors


@dataclass(frozen=True)
class ParamTotals(Record):
    """The model's parameters in all: trainable, frozen, their share and tensors."""

    trainable: int = 0
    frozen: int = 0
    all: int | None = None
    trainable_share: float = 0.0
    trainable_tensors: int = 0


@dataclass(frozen=True)
class ParameterAudit(Record):
    """runs/<run>/audit.json: which parameters train and what a checkpoint holds
    (lib.models.audit.parameter_audit; written by stages.train)."""

    method: str = ""
    adapted_modules: list[str] | None = None
    adapted_summary: str | None = None
    modules_to_save: list[str] = field(default_factory=list)
    saves: str = ""  # model | adapter: what a checkpoint holds
    saved_params: int = 0
    notes: list[str] | None = None

    @property
    def totals(self) -> ParamTotals:
        return self.part(ParamTotals, "totals") or ParamTotals(self.path, {}, where="totals")

    @property
    def groups(self) -> dict[str, ParamCount]:
        return self.parts_by_key(ParamCount, "groups")

    @property
    def bytes_by_dtype(self) -> dict[str, ParamCount]:
        return self.parts_by_key(ParamCount, "bytes_by_dtype")

    def check_parts(self) -> None:
        _ = self.totals, self.groups, self.bytes_by_dtype


@dataclass(frozen=True)
class TrainStep(Record):
    """One line of runs/<run>/metrics.jsonl (stages.train): an optimizer step's loss and rate,
    or a validation pass (`val_loss`) at that step."""

    step: int = 0
    epoch: float | None = None
    loss: float | None = None
    val_loss: float | None = None
    lr: float | None = None
    elapsed_s: float | None = None  # since the run's start
    tokens: float | None = None  # the step's input tokens
    memory_bytes: int | None = None  # the device's peak so far
    seconds: float | None = None  # the step's own


@dataclass(frozen=True)
class GateOverride(Record):
    """A run that went past the platform gate: the checks it lacked there, and why."""

    why: str | None = None
    missing: dict[str, Any] | list[str] | None = None  # the checks, by kind


@dataclass(frozen=True)
class PlatformGate(Record):
    """What the platform gate found for a training run (`platform_gate` in its config.json,
    one line of platforms.jsonl per resume; stages.smoke.platform)."""

    platform: dict[str, Any] | None = None  # core.env.platform_of this process's environment
    command: str | None = None  # "resume" on a platforms.jsonl line
    at: str | None = None

    @property
    def override(self) -> GateOverride | None:
        return self.part(GateOverride, "override")

    def check_parts(self) -> None:
        _ = self.override


@dataclass(frozen=True)
class PowerEstimate(Record):
    """The smallest effect the validation split can show (stages.hypothesis.power; kept in a
    hypothesis record as `power`)."""

    metric: str | None = None
    level: float | None = None  # the one-sided test's
    power: float | None = None
    detectable_effect: float | None = None  # None: not known (`note` says why)
    n: int | None = None
    note: str | None = None
    source: str | None = None  # the predictions it was estimated from
    warnings: list[str] | None = None
    per_category: dict[str, Any] | None = None


@dataclass(frozen=True)
class Prediction(Record):
    """One line of runs/<run>/predictions-<split>.jsonl (stages.evaluate): an example's gold
    and prediction, as written (a label, a JSON value, a verdict); an image example names its
    stored file (images/<sha256>.<ext> in the snapshot)."""

    id: str | int = ""
    image: str | None = None

    gold = as_written("gold")
    prediction = as_written("prediction")
    raw_output = as_written("raw_output")  # the model's text, before parsing
    verdicts = as_written("verdicts")  # a generative task's judgement of the example
    correct = as_written("correct")
    scores = as_written("scores")  # a classifier's {label: probability}

    @classmethod
    def rows(
        cls, rows: Sequence[Mapping[str, Any] | Prediction], source: Path | str
    ) -> list[Prediction]:
        """The lines of a predictions file (`source`, named in an error with the line), typed;
        rows already typed are kept."""
        return [
            r if isinstance(r, Prediction) else cls.of(source, r, f"line {i + 1}")
            for i, r in enumerate(rows)
        ]
