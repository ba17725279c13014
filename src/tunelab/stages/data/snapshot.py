"""Data snapshots read back: `records/data/<snapshot-id>/`, content-addressed, verified on every load.

A snapshot is written by `tunelab.stages.data.stage.run`. The test split is sealed: it is
read only through `open_test_split`, which logs who opened it, when and why in the ledger.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import EvaluationError, SnapshotError
from tunelab.core.evidence import latest_snapshot_id
from tunelab.core.hashing import sha256_bytes, sha256_json
from tunelab.core.record_data import DataManifest
from tunelab.stages.data.splits import SPLITS

if TYPE_CHECKING:
    from tunelab.core.study import Study


SPLIT_FILES = {s: f"{s}.jsonl" for s in SPLITS}
ID_CHARS = 16


def data_dir(study: Study) -> Path:
    return study.records / "data"


def snapshot_identity(m: dict[str, Any]) -> str:
    """The snapshot id: a hash of the inputs, the settings and the outputs."""
    return sha256_json(
        {
            "format_version": m["format_version"],
            "source": {
                "format": m["source"]["format"],
                "files": [[f["path"], f["sha256"]] for f in m["source"]["files"]],
            },
            "fields": m["fields"],
            "task_labels": m["task_labels"],
            "cleaning": m["cleaning"]["sha256"],
            "transforms": m["transforms"]["sha256"],
            "splits": m["splits"]["sha256"],
            "dedup": m["dedup"]["sha256"],
            "files": m["files"],
        }
    )[:ID_CHARS]


def content_sha256(manifest: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in manifest.items() if k != "content_sha256"})


@dataclass
class Snapshot:
    """A verified snapshot. `rows("train" | "validation")`; the test split is sealed."""

    id: str
    dir: Path
    manifest: dict[str, Any]

    @cached_property
    def record(self) -> DataManifest:
        """The manifest read typed (a damaged one raises the located `StudyError`)."""
        return DataManifest.of(self.dir / "manifest.json", self.manifest)

    @property
    def labels(self) -> list[str] | None:
        return self.record.labels

    @property
    def counts(self) -> dict[str, int]:
        """Examples per split."""
        return self.record.counts.final or {}

    def rows(self, split: str) -> list[dict[str, Any]]:
        """The examples of a split, re-checked against the manifest's sha256 as they are read."""
        if split == "test":
            raise EvaluationError(
                f"the test split of snapshot {self.id} is sealed",
                hint="evaluate on it only with `tunelab eval RUN --split test --final`, which logs the "
                "opening (library code: tunelab.stages.data.open_test_split)",
            )
        if split not in SPLITS:
            raise SnapshotError(
                f"no split {split!r} in snapshot {self.id}", hint="use train or validation"
            )
        return self._read(split)

    def _read(self, split: str) -> list[dict[str, Any]]:
        name = SPLIT_FILES[split]
        data = _verified_bytes(self.dir, name, self.record.files.get(name), self.id)
        rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
        for row in rows:  # an image example: where its verified file lies
            if "image" in row:
                row["image_path"] = str(self.dir / row["image"])
        return rows


def _tampered(snapshot_id: str, what: str) -> SnapshotError:
    return SnapshotError(
        f"snapshot {snapshot_id}: {what}; the snapshot was modified after it was made",
        hint="never edit snapshot files: rebuild with `tunelab data` (a new snapshot id) and "
        "rerun the stages that used this one",
    )


def _verified_bytes(folder: Path, name: str, expected: str | None, snapshot_id: str) -> bytes:
    path = folder / name
    if expected is None:
        raise _tampered(snapshot_id, f"{name} is not listed in its manifest")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _tampered(snapshot_id, f"{path} is missing") from None
    if sha256_bytes(data) != expected:
        raise _tampered(snapshot_id, f"{path} no longer matches its sha256 in manifest.json")
    return data


def list_snapshots(study: Study) -> list[str]:
    root = data_dir(study)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _resolve_id(study: Study, snapshot_id: str | None) -> str:
    if snapshot_id is None:
        sid = latest_snapshot_id(study)
        if sid is None:
            raise SnapshotError(
                f"{study.root}: no data snapshot yet", hint=f"run `tunelab data -s {study.root}`"
            )
        return sid
    present = list_snapshots(study)
    if snapshot_id in present:
        return snapshot_id
    matches = [s for s in present if s.startswith(snapshot_id)]
    if len(matches) == 1:
        return matches[0]
    raise SnapshotError(
        f"no data snapshot {snapshot_id!r}"
        + (f" (ambiguous: {matches})" if matches else "")
        + f" in {data_dir(study)}",
        hint="snapshots: " + (", ".join(present) or "none; run `tunelab data`"),
    )


def load_snapshot(study: Study, snapshot_id: str | None = None) -> Snapshot:
    """Open a snapshot (None: the latest) after checking every file against its manifest.

    Raises SnapshotError when it is missing, unfinished or tampered with.
    """
    sid = _resolve_id(study, snapshot_id)
    folder = data_dir(study) / sid
    if not (folder / "DONE").exists():
        raise SnapshotError(
            f"snapshot {sid} is incomplete (no DONE marker)",
            hint="rebuild it with `tunelab data`",
        )
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        raise _tampered(sid, "manifest.json is missing or not valid JSON") from None
    if manifest.get("content_sha256") != content_sha256(manifest):
        raise _tampered(sid, "manifest.json no longer matches its content_sha256")
    try:
        identity = snapshot_identity(manifest)
    except (KeyError, TypeError):
        raise _tampered(sid, "manifest.json lacks fields its id is made of") from None
    if identity != sid or manifest.get("snapshot_id") != sid:
        raise _tampered(sid, "the folder name, the manifest's snapshot_id and its content disagree")
    snapshot = Snapshot(sid, folder, manifest)
    files = snapshot.record.files
    listed = set(files) | {"manifest.json", "DONE"}
    present = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    extra = sorted(name for name in present if name not in listed)
    if extra:
        raise _tampered(sid, f"unexpected file(s) {extra} in {folder}")
    for name, sha in files.items():
        _verified_bytes(folder, name, sha, sid)
    return snapshot


def open_test_split(
    study: Study,
    snapshot: Snapshot | str,
    who: str,
    why: str,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """The sealed test split: verified, then the opening (who, when, why) logged in the ledger."""
    if not who or not who.strip() or not why or not why.strip():
        raise EvaluationError(
            "opening the test split needs who opens it and why",
            hint="e.g. open_test_split(study, snap, who='tunelab eval --final', why='final "
            "evaluation of the chosen variant')",
        )
    snap = snapshot if isinstance(snapshot, Snapshot) else load_snapshot(study, snapshot)
    name = SPLIT_FILES["test"]
    _verified_bytes(snap.dir, name, snap.record.files.get(name), snap.id)
    study.ledger.log_test_opening(who, why, snap.id, run_id)
    return snap._read("test")
