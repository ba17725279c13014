"""The checks `tunelab data` runs on the rows it read, before any cleaning: one list, in order.

Each check takes the rows read (with the study config) and returns notes for the manifest, or
raises DataError naming the row (file and line), the field and the fix. A new check is one
function appended to `SOURCE_CHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunelab.config import StudyConfig
from tunelab.data.readers import SourceRow
from tunelab.errors import DataError


@dataclass(frozen=True)
class RowsRead:
    """What a check sees: the source rows, in source order, and the study's config."""

    rows: list[SourceRow]
    config: StudyConfig
    source_path: Path

    @property
    def task_labels(self) -> list[str] | None:
        """task.labels sorted, or None when the labels are read from the data."""
        labels = self.config.task.labels
        return sorted(labels) if labels else None

    @property
    def has_label(self) -> bool:
        """Whether the rows carry a label (a label field, or one folder per label)."""
        data = self.config.data
        return data.fields.label is not None or data.source.format == "folder"


Check = Callable[[RowsRead], list[str]]


def check_not_empty(read: RowsRead) -> list[str]:
    if not read.rows:
        raise DataError(
            f"{read.source_path}: the data set is empty (no rows)",
            hint="point data.source.path at the data, or check data.source.format and glob",
        )
    return []


def check_labels(read: RowsRead) -> list[str]:
    """Every label is one of task.labels (when set); a task label without a row is noted."""
    known = read.task_labels
    if not read.has_label or not known:
        return []
    allowed = set(known)
    for row in read.rows:
        if row.label not in allowed:
            raise DataError(
                f"{row.where}: unknown label {row.label!r} (field label); task.labels "
                f"lists {sorted(allowed)}",
                hint="fix the row, or add the label to task.labels in study.yaml",
            )
    missing = sorted(allowed - {r.label for r in read.rows})
    return [f"labels in task.labels with no example: {missing}"] if missing else []


SOURCE_CHECKS: list[Check] = [check_not_empty, check_labels]


def run_checks(read: RowsRead, checks: list[Check] | None = None) -> list[str]:
    """Run the checks (default `SOURCE_CHECKS`) in order; their notes, in that order (the first
    failing check raises)."""
    notes: list[str] = []
    for check in SOURCE_CHECKS if checks is None else checks:
        notes += check(read)
    return notes
