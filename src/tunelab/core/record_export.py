"""The pieces of an export's manifest (`record_types.ExportManifest`), read typed: what the
folder holds (`ExportArtifact`), the base it is bound to (`ExportBase`, a QLoRA base's 4-bit
`Quantization`), the task and hypothesis it serves (`ExportTask`, `ExportHypothesis`), where it
was trained and exported (`ExportEnvironment`), its results against the baseline
(`ExportResults`), the guardrails its run met (`ExportGuardrails`), a merged export's check
against the adapter (`MergeCheck`) and what it cannot be trusted with (`LimitationsDetail`).
The example it carries (example.json) reads as `StoredExample`.

Written by `stages.export.stage` (the merge figures by `stages.export.merge`). Each piece is a
`Record` read at its place in the manifest, so a damaged one raises the located `StudyError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from tunelab.core.record_base import Record
from tunelab.core.record_data import HubData
from tunelab.core.record_parts import CompareBaseline, CompareEntry, GuardrailVerdict
from tunelab.core.run_parts import Prediction

__all__ = [
    "EnvSummary",
    "ExportArtifact",
    "ExportBase",
    "ExportEnvironment",
    "ExportGuardrails",
    "ExportHypothesis",
    "ExportResults",
    "ExportTask",
    "FailureKinds",
    "LimitationsDetail",
    "MergeCheck",
    "ProcessorGap",
    "Quantization",
    "Regression",
    "StoredExample",
    "Truncation",
    "VerifySummary",
]


@dataclass(frozen=True)
class ExportArtifact(Record):
    """What the export folder holds at its top, and how it loads."""

    kind: str = ""  # adapter | model
    dir: str | None = None  # an adapter's folder inside the export ("." for the top)
    method: str | None = None  # full | lora | qlora | freeze
    format: str | None = None  # peft | safetensors
    weights: str | None = None
    merged: bool | None = None
    dtype: str | None = None  # a merged model's

    @property
    def text(self) -> str:
        """What it is, in words, with the call that loads it."""
        if self.kind == "adapter":
            where = "" if self.dir == "." else f" in {self.dir}/"
            four_bit = " for the 4-bit base" if self.method == "qlora" else ""
            return f"{self.method} adapter{four_bit}{where} (PeftModel.from_pretrained)"
        if self.merged:
            return f"{self.method} merged into the base, {self.dtype} (from_pretrained)"
        return f"whole model, {self.format} (from_pretrained)"


@dataclass(frozen=True)
class ExportBase(Record):
    """The base model an export is bound to: its identity and where it was read at export."""

    name: str | None = None
    revision: str | None = None
    sha256: str | None = None
    architecture: str | None = None
    trust_remote_code: bool | None = None
    path_at_export: str | None = None
    files: dict[str, str] | None = None  # file name -> sha256
    patterns: list[str] | None = None  # the hub files the base was read from
    source: dict[str, Any] | None = None  # {hub} | {gguf_file, gguf_sha256}: where it came from

    @property
    def quantization(self) -> Quantization | None:
        """A QLoRA run's 4-bit settings (None for a base loaded in full precision)."""
        return self.part(Quantization, "quantization")

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file (its path in the repo or folder) a converted base came from."""
        return (self.source or {}).get("gguf_file")

    @property
    def gguf_sha256(self) -> str | None:
        return (self.source or {}).get("gguf_sha256")

    @property
    def hub(self) -> HubData | None:
        """The hub commit the base was read at (None for a local base)."""
        return self.part(HubData, "hub")

    @property
    def argument(self) -> str | None:
        """What `check-export --base` takes for it: repo@commit, else the folder at export."""
        hub = self.hub
        return f"{hub.repo_id}@{hub.commit}" if hub else self.path_at_export

    def check_parts(self) -> None:
        _ = self.hub, self.quantization


@dataclass(frozen=True)
class ExportGuardrails(Record):
    """The exported run's guardrails: whether all passed (None: not compared), and each."""

    RENAMED: ClassVar = {"pass": "passed"}

    passed: bool | None = None

    @property
    def verdicts(self) -> list[GuardrailVerdict]:
        return self.parts(GuardrailVerdict, "verdicts")

    def check_parts(self) -> None:
        _ = self.verdicts


@dataclass(frozen=True)
class MergeCheck(Record):
    """A merged model against the adapter it was merged from, on a few examples."""

    examples: int = 0
    dtype: str | None = None  # bf16 | fp32
    dequantized_from: dict[str, Any] | None = None  # a QLoRA base's 4-bit settings
    logits_max_abs_diff: float = 0.0
    greedy_agreement: float = 0.0
    prediction_agreement: float = 0.0
    tolerance: dict[str, Any] | None = None  # stages.export.merge.MergeTolerance
    within_tolerance: bool | None = None

    @property
    def logits_bound(self) -> Any:
        return (self.tolerance or {}).get("logits_max_abs_diff")


@dataclass(frozen=True)
class Quantization(Record):
    """The 4-bit settings a QLoRA run's base was loaded with (lib.models.quantize)."""

    bits: int | None = None
    quant_type: str | None = None
    double_quant: bool | None = None
    compute_dtype: str | None = None
    bitsandbytes: str | None = None


@dataclass(frozen=True)
class ExportTask(Record):
    """The task the exported model does: its kind, and its labels or fields."""

    kind: str | None = None
    labels: list[str] | None = None
    fields: list[str] | None = None


@dataclass(frozen=True)
class ExportHypothesis(Record):
    """The hypothesis the exported run tested: its version and sha256, the latest version, and
    the `hypothesis` section as locked (behaviour, primary metric, minimum improvement)."""

    version: int | None = None
    sha256: str | None = None
    latest_version: int | None = None
    behaviour: str | None = None
    primary_metric: str | None = None
    min_improvement: float | None = None


@dataclass(frozen=True)
class EnvSummary(Record):
    """Where the model was trained or exported, in short (stages.export.stage._env_summary)."""

    python: str | None = None
    torch: str | None = None
    backend: str | None = None
    cuda: str | None = None
    rocm: str | None = None
    gpus: list[str | None] | None = None
    cpu: str | None = None


@dataclass(frozen=True)
class ExportEnvironment(Record):
    """The training run's environment and the export's own."""

    @property
    def training(self) -> EnvSummary | None:
        return self.part(EnvSummary, "training")

    @property
    def export(self) -> EnvSummary | None:
        return self.part(EnvSummary, "export")

    def check_parts(self) -> None:
        _ = self.training, self.export


@dataclass(frozen=True)
class ExportResults(CompareEntry):
    """The exported run's comparison row, with the baseline and the bootstrap it was set
    against (the manifest's `results`)."""

    bootstrap: dict[str, Any] | None = None

    @property
    def baseline(self) -> CompareBaseline | None:
        return self.part(CompareBaseline, "baseline")

    def check_parts(self) -> None:
        super().check_parts()
        _ = self.baseline


@dataclass(frozen=True)
class Regression(Record):
    """A category or field whose metric went down against the baseline."""

    scope: str = ""  # category | field
    item: str = ""
    metric: str = ""
    baseline: float | None = None
    variant: float | None = None
    delta: float = 0.0


@dataclass(frozen=True)
class FailureKinds(Record):
    """How the validation predictions failed: by kind, and the most frequent confusions."""

    n: int = 0
    failures: dict[str, int] | None = None
    top_confusions: dict[str, int] | None = None


@dataclass(frozen=True)
class Truncation(Record):
    """The examples of one split cut by preprocess.max_seq_len."""

    n: int = 0
    truncated: int = 0
    share: float = 0.0


@dataclass(frozen=True)
class ProcessorGap(Record):
    """An exported image processor against the training transforms (processor_gap)."""

    matches: bool = False
    max_abs_diff: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class VerifySummary(Record):
    """A run's latest verification as an export keeps it: `record_types.Verify`'s verdict."""

    record: str | None = None  # the verify record's file name
    passed: bool = False
    reason: str | None = None
    finished_at: str | None = None
    environment: dict[str, Any] | None = None


@dataclass(frozen=True)
class LimitationsDetail(Record):
    """What the export found the model cannot be trusted with (the manifest's
    `limitations_detail`; `stages.export.limitations` says it in sentences)."""

    not_compared: str | None = None  # why the run was not compared with the baseline
    test_openings: int | None = None
    test_openings_log: list[Any] | None = None
    notes: list[str] | None = None

    @property
    def regressed(self) -> list[Regression]:
        return self.parts(Regression, "regressed")

    @property
    def guardrails_failed(self) -> list[GuardrailVerdict]:
        return self.parts(GuardrailVerdict, "guardrails_failed")

    @property
    def failure_kinds(self) -> FailureKinds | None:
        return self.part(FailureKinds, "failure_kinds")

    @property
    def truncation(self) -> dict[str, Truncation]:
        return self.parts_by_key(Truncation, "truncation")

    @property
    def verify(self) -> VerifySummary | None:
        """The run's latest verification, in short (None before any)."""
        return self.part(VerifySummary, "verify")

    @property
    def quantization(self) -> Quantization | None:
        return self.part(Quantization, "quantization")

    @property
    def merge(self) -> MergeCheck | None:
        return self.part(MergeCheck, "merge")

    @property
    def processor(self) -> ProcessorGap | None:
        return self.part(ProcessorGap, "processor")

    def check_parts(self) -> None:
        _ = self.regressed, self.guardrails_failed, self.failure_kinds, self.truncation
        _ = self.verify, self.quantization, self.merge, self.processor


@dataclass(frozen=True)
class StoredExample(Record):
    """example.json: one validation example (a data row), the run's recorded prediction of it
    and, for a merged export, the merged model's."""

    example: dict[str, Any] = field(default_factory=dict)

    @property
    def recorded(self) -> Prediction:
        return self.part(Prediction, "recorded") or Prediction(self.path, {}, where="recorded")

    @property
    def merged(self) -> Prediction | None:
        return self.part(Prediction, "merged")

    def check_parts(self) -> None:
        _ = self.recorded, self.merged
