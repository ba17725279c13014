"""What `tunelab check-export` found (`ExportCheck`): the export's files against its manifest,
the base folder against the recorded hashes, the load, and the recorded example run again.

Returned by `stages.export.check.check_export` (and printed by `--json` as it is); the CLI reads
it as `ExportCheck`, so a malformed result raises the located `StudyError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tunelab.core.record_base import Record, as_written
from tunelab.core.record_data import HubData
from tunelab.core.record_export import ExportArtifact, ProcessorGap

__all__ = ["BaseCheck", "ExampleCheck", "ExportCheck", "FilesCheck"]


@dataclass(frozen=True)
class FilesCheck(Record):
    """The export's files against the sha256 its manifest lists (and the manifest's own)."""

    files_checked: int = 0
    manifest_sha256: str | None = None


@dataclass(frozen=True)
class BaseCheck(Record):
    """The base folder checked: where it is, what `--base` named, and the files that matched."""

    RENAMED: ClassVar = {"path": "folder"}

    folder: str = ""
    files_checked: int = 0
    given: str | None = None

    @property
    def hub(self) -> HubData | None:
        """The hub commit the export was trained on (None for a local base)."""
        return self.part(HubData, "hub")

    def check_parts(self) -> None:
        _ = self.hub


@dataclass(frozen=True)
class ExampleCheck(Record):
    """The recorded example run through the exported model: its output against the recording
    (`gold`, `recorded`, `output`, `raw_output`: the values as written)."""

    id: str | int = ""
    scores_max_diff: float | None = None
    matches_recorded: bool = False
    seconds: float | None = None

    gold = as_written("gold")
    recorded = as_written("recorded")
    output = as_written("output")
    raw_output = as_written("raw_output")


@dataclass(frozen=True)
class ExportCheck(Record):
    """`check_export`'s result: the export, its run and base, each check, the load time."""

    export: str = ""
    run_id: str | None = None
    base_name: str | None = None
    base_sha256: str | None = None
    load_s: float = 0.0
    binding: dict[str, Any] | None = None  # {checked, base_model_name_or_path}

    @property
    def artifact(self) -> ExportArtifact:
        found = self.part(ExportArtifact, "artifact")
        return found or ExportArtifact(self.path, {}, where="artifact")

    @property
    def files(self) -> FilesCheck:
        return self.part(FilesCheck, "files") or FilesCheck(self.path, {}, where="files")

    @property
    def base(self) -> BaseCheck:
        return self.part(BaseCheck, "base") or BaseCheck(self.path, {}, where="base")

    @property
    def example(self) -> ExampleCheck | None:
        """None for an export without a recorded example."""
        return self.part(ExampleCheck, "example")

    @property
    def processor(self) -> ProcessorGap | None:
        """An image export's processor against the training transforms."""
        return self.part(ProcessorGap, "processor")

    def check_parts(self) -> None:
        _ = self.artifact, self.files, self.base, self.example, self.processor
