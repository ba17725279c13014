"""The pieces of an export's manifest (`record_types.ExportManifest`), read typed: what the
folder holds (`ExportArtifact`), the base it is bound to (`ExportBase`), the guardrails its run
met (`ExportGuardrails`) and a merged export's check against the adapter (`MergeCheck`).

Written by `stages.export.stage` (the merge figures by `stages.export.merge`). Each piece is a
`Record` read at its place in the manifest, so a damaged one raises the located `StudyError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tunelab.core.record_base import Record
from tunelab.core.record_data import HubData

__all__ = ["ExportArtifact", "ExportBase", "ExportGuardrails", "MergeCheck"]


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
        _ = self.hub


@dataclass(frozen=True)
class ExportGuardrails(Record):
    """The exported run's guardrails: whether all passed (None: not compared), and each."""

    RENAMED: ClassVar = {"pass": "passed"}

    passed: bool | None = None
    verdicts: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class MergeCheck(Record):
    """A merged model against the adapter it was merged from, on a few examples."""

    examples: int = 0
    logits_max_abs_diff: float = 0.0
    greedy_agreement: float = 0.0
    prediction_agreement: float = 0.0
    tolerance: dict[str, Any] | None = None  # stages.export.merge.MergeTolerance
    within_tolerance: bool | None = None

    @property
    def logits_bound(self) -> Any:
        return (self.tolerance or {}).get("logits_max_abs_diff")
