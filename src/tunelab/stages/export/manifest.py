"""The export format: its file names, the manifest's own sha256, and the folder's file hashes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunelab.core.hashing import sha256_file, sha256_json
from tunelab.core.record_types import ExportManifest

MANIFEST = "tunelab-manifest.json"
# /2: the adapter (or whole model) at the top of the folder, so that plain
# `PeftModel.from_pretrained(base, EXPORT)` loads it; /1 kept it in adapter/ (or model/), which
# readers still find through the manifest's artifact.dir.
FORMAT = "tunelab-export/2"
READABLE_FORMATS = ("tunelab-export/1", FORMAT)
ARTIFACT_DIR = "."
# Files that hold (or may hold) pickled Python objects: never exported, never loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
TOKENIZER_DIR = "tokenizer"
EXAMPLE_FILE = "example.json"
# Files of the export folder that are not listed in the manifest's file hashes.
UNLISTED = {MANIFEST, "DONE"}


def as_manifest(m: ExportManifest | Mapping[str, Any]) -> ExportManifest:
    """A manifest read typed: one already read, or one built in memory (named as the file it
    is written to)."""
    return m if isinstance(m, ExportManifest) else ExportManifest.of(MANIFEST, m)


def manifest_sha256(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own `manifest_sha256` field."""
    return sha256_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})


def tree_hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root but the unlisted ones."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() not in UNLISTED
    }


def pickle_files(root: Path) -> list[str]:
    """Relative paths of the files under root that may hold pickles."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name.lower().endswith(PICKLE_SUFFIXES)
    )
