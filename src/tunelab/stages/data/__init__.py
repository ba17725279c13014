"""Stage 2, data: readers, cleaning rules, seeded stable splits, duplicates, sealed snapshots.

    build_snapshot(study, progress=None) -> manifest dict (records/data/<snapshot-id>/)
    load_snapshot(study, snapshot_id=None) -> Snapshot (.id, .manifest, .labels, .rows(split))
    open_test_split(study, snapshot, who, why, run_id=None) -> list of examples (logged)
    latest_snapshot_id(study) -> str | None (the rule lives in core.evidence)

An example is a dict {"id", "text", "label", "target"}.
"""

from tunelab.core.evidence import latest_snapshot_id
from tunelab.stages.data.snapshot import (
    Snapshot,
    build_snapshot,
    list_snapshots,
    load_snapshot,
    open_test_split,
)

__all__ = [
    "Snapshot",
    "build_snapshot",
    "latest_snapshot_id",
    "list_snapshots",
    "load_snapshot",
    "open_test_split",
]
