"""A snapshot's manifest.json, built from what each step of `tunelab.stages.data.stage.run` found:
the source and its files, the cleaning rules, the transforms, the splits, the duplicate search
and the counts, each settings block with its sha256, and the snapshot id (a hash of the inputs,
the settings and the outputs, `tunelab.stages.data.snapshot.snapshot_identity`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.core.config_sections import DataConfig
from tunelab.core.hashing import sha256_bytes, sha256_json
from tunelab.core.ledger import utc_now
from tunelab.stages.data import dedup
from tunelab.stages.data.checks import RowsRead
from tunelab.stages.data.cleaning import CleaningResult, rules_sha256
from tunelab.stages.data.snapshot import snapshot_identity
from tunelab.stages.data.source_files import SourceData
from tunelab.stages.data.splits import SPLITS, counts_by_category

FORMAT_VERSION = 1
NORMALIZATION = "NFKC, lower case, whitespace runs to one space"


@dataclass
class Kept:
    """The rows that survive cleaning and sampling, in source order."""

    index: list[int]  # into the source rows
    texts: list[str]  # cleaned
    keys: list[str]  # sha256 of the normalized text: the split key
    normalized: Any  # the normalized texts (an Arrow array, as dedup takes them)
    sampled_out: int


@dataclass
class Split:
    splits: list[str]  # one per kept row
    method: str  # "column" | "hash"
    moved: list[dict[str, Any]]  # rows moved so that small categories reach every split
    notes: list[str]


@dataclass
class Duplicates:
    pairs: list[Any]  # dedup.Pair over kept rows
    lsh: dict[str, Any]  # the LSH settings used (the manifest's dedup algorithm)
    removed: dict[int, Any]  # kept row -> (the row it duplicates, its pair or None)


def _transforms(cfg: DataConfig, images: bool = False) -> dict[str, Any]:
    """How ids, split keys and samples are made from the rows (hashed into the snapshot id)."""
    return {
        "id": "data.fields.id, else sha256(text, label, target)[:16]"
        if cfg.source.format != "folder"
        else "path of the file inside data.source.path",
        "split_key": "sha256 of the decoded pixels" if images else "sha256 of the normalized text",
        "normalization": NORMALIZATION,
        "max_examples": cfg.max_examples,
        "encoding_errors": cfg.source.encoding_errors,
        "glob": cfg.source.glob if cfg.source.format == "folder" else None,
    }


def _source_entry(cfg: DataConfig, read: RowsRead, src: SourceData) -> dict[str, Any]:
    return {
        "format": cfg.source.format,
        "path": cfg.source.path,
        "resolved_path": str(read.source_path),
        "num_files": len(src.files),
        "files": src.files,
        "replaced_invalid_utf8_bytes": src.replaced_bytes,
        **({"hub": src.hub} if src.hub else {}),
        **({"links_followed": src.links} if src.links else {}),
    }


def _dedup_entry(cfg: DataConfig, dups: Duplicates, images: bool) -> dict[str, Any]:
    dedup_config = cfg.dedup.model_dump(mode="json")
    algorithm = dups.lsh
    if not images:
        algorithm = {
            "version": dedup.DEDUP_ALGORITHM_VERSION,
            "minhash_seed": 1,
            "verification": "exact Jaccard of word shingle sets",
            **dups.lsh,
        }
    return {
        "config": dedup_config,
        "policy": cfg.dedup.policy,
        "sha256": sha256_json(dedup_config),
        "normalization": NORMALIZATION,
        "shingle_normalization": dedup.SHINGLE_NORMALIZATION,
        "algorithm": algorithm,
    }


def _counts_entry(
    src: SourceData,
    cleaned: CleaningResult,
    kept: Kept,
    split: Split,
    duplicates: dict[str, Any],
    examples: dict[str, list[dict[str, Any]]],
    labels: list[str | None],
) -> dict[str, Any]:
    return {
        "rows_read": len(src.rows),
        "dropped_by_cleaning": len(cleaned.dropped),
        "sampled_out": kept.sampled_out,
        "removed_as_duplicates": len(duplicates["removed"]),
        "before_dedup": counts_by_category(split.splits, labels),
        "final": {s: len(examples[s]) for s in SPLITS},
        "per_category": counts_by_category(
            [s for s in SPLITS for _ in examples[s]],
            [e["label"] for s in SPLITS for e in examples[s]],
        ),
    }


def build_manifest(
    read: RowsRead,
    src: SourceData,
    cleaned: CleaningResult,
    kept: Kept,
    split: Split,
    dups: Duplicates,
    duplicates: dict[str, Any],
    examples: dict[str, list[dict[str, Any]]],
    labels: list[str | None],
    ids: list[str],
    outputs: dict[str, bytes],
    notes: list[str],
) -> dict[str, Any]:
    """manifest.json, its snapshot id included (without its content_sha256)."""
    cfg = read.config.data
    task_labels = read.task_labels
    label_set = (
        task_labels
        if task_labels
        else (sorted({lab for lab in labels if lab is not None}) if read.has_label else None)
    )
    images = read.config.task.kind == "image_classification"
    transforms = _transforms(cfg, images)
    splits_config = cfg.splits.model_dump(mode="json")
    manifest: dict[str, Any] = {
        "snapshot_id": "",
        "format_version": FORMAT_VERSION,
        "created_at": utc_now(),
        "source": _source_entry(cfg, read, src),
        "fields": cfg.fields.model_dump(mode="json"),
        "task_labels": task_labels,
        "cleaning": {
            "rules": cleaned.effects,
            "sha256": rules_sha256(cfg.cleaning),
            "dropped": len(cleaned.dropped),
        },
        "transforms": {**transforms, "sha256": sha256_json(transforms)},
        "splits": {
            "config": splits_config,
            "method": split.method,
            "sha256": sha256_json({"config": splits_config, "m": split.method}),
            "moved_to_cover_small_categories": [
                {**mv, "row": ids[kept.index[mv["row"]]]} for mv in split.moved
            ],
        },
        "dedup": _dedup_entry(cfg, dups, images),
        "counts": _counts_entry(src, cleaned, kept, split, duplicates, examples, labels),
        "duplicates": duplicates["summary"],
        "labels": label_set,
        "files": {name: sha256_bytes(data) for name, data in sorted(outputs.items())},
        "notes": notes,
    }
    manifest["snapshot_id"] = snapshot_identity(manifest)
    return manifest
