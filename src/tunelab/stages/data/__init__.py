"""Stage 2, data: readers, cleaning rules, seeded stable splits, duplicates, sealed snapshots.

    stage.run(study, progress=None) -> manifest dict (records/data/<snapshot-id>/)
    load_snapshot(study, snapshot_id=None) -> Snapshot (.id, .manifest, .labels, .rows(split))
    open_test_split(study, snapshot, who, why, run_id=None) -> list of examples (logged)
    latest_snapshot_id(study) -> str | None (the rule lives in core.evidence)

An example is a dict {"id", "text", "label", "target"}.

`stage.run`'s `progress(what, done, total)` (core.progress) hears of inputs of 5,000 rows
or more ("reading" with total None, the duplicate search's stages with total 1); the manifest it returns
has `"unchanged": True` when an identical snapshot already existed (same id, reused). The folder
also holds `dropped.jsonl` and `DONE`. `Snapshot.dir`, `Snapshot.counts` (`{split: n}` after
dedup), `Snapshot.labels` (sorted, or None); `rows(split)` re-checks the split file's sha256 on
every read, and `rows("test")` raises EvaluationError (hint: `tunelab eval RUN --split test
--final`). `open_test_split` takes a `Snapshot` or an id, needs non-empty `who` and `why`, and
re-verifies the file. `latest_snapshot_id` is the snapshot of the most recent `tunelab data`
(the ledger's `data:snapshot` events); `list_snapshots(study)`. `manifest["labels"]` is
`task.labels` sorted when set, else the labels found. An image example adds `image` and
`image_sha256` (`tunelab.stages.data.images`); `Snapshot.rows()` adds `image_path` (the stored
file, absolute).
"""

from tunelab.core.evidence import latest_snapshot_id
from tunelab.stages.data.snapshot import Snapshot, list_snapshots, load_snapshot, open_test_split

__all__ = [
    "Snapshot",
    "latest_snapshot_id",
    "list_snapshots",
    "load_snapshot",
    "open_test_split",
]
