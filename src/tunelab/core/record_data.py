"""A data snapshot's manifest read back typed: `DataManifest` and the pieces nested in it.

records/data/<snapshot>/manifest.json (and duplicates.json, `Duplicates`) is written by `stages.data.manifest.build_manifest`
(`stages.data.stage.run` returns it, with `"unchanged": True` when an identical snapshot already
existed). Every piece is a `Record` read at its place in the file (`where`, e.g.
`counts.per_category`), so a damaged one raises the located `StudyError` (core/record_base).
Fields a manifest of an older tunelab may lack are `| None`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from tunelab.core.record_base import Record

__all__ = [
    "CleaningRule",
    "DataCleaning",
    "DataCounts",
    "DataDedup",
    "DataManifest",
    "DataSource",
    "DataSplits",
    "DedupSettings",
    "DuplicatePair",
    "DuplicateSummary",
    "Duplicates",
    "HubData",
    "SplitSettings",
]


@dataclass(frozen=True)
class HubData(Record):
    """A hub data set the source was read from, pinned to its commit."""

    repo_id: str = ""
    commit: str = ""


@dataclass(frozen=True)
class DataSource(Record):
    """Where the rows were read: the configured source, its files and what reading replaced."""

    RENAMED: ClassVar = {"path": "source_path"}

    format: str | None = None
    source_path: str | None = None  # data.source.path as configured
    resolved_path: str | None = None
    num_files: int | None = None
    files: list[dict[str, Any]] | None = None  # {path, sha256, bytes}
    replaced_invalid_utf8_bytes: int | None = None

    @property
    def hub(self) -> HubData | None:
        return self.part(HubData, "hub")

    @property
    def location(self) -> str:
        """The hub repository at its commit, else the configured path."""
        hub = self.hub
        return f"{hub.repo_id}@{hub.commit[:12]}" if hub else str(self.source_path)

    def check_parts(self) -> None:
        _ = self.hub


@dataclass(frozen=True)
class CleaningRule(Record):
    """One cleaning rule as applied: rows it changed and dropped, and its own arguments."""

    rule: str = ""
    changed: int | None = None
    dropped: int | None = None

    @property
    def arguments(self) -> dict[str, Any]:
        """The rule's arguments as written (everything but its name and counts)."""
        return {k: v for k, v in self.raw.items() if k not in ("rule", "changed", "dropped")}


@dataclass(frozen=True)
class DataCleaning(Record):
    """The cleaning rules in order, their sha256 and the rows they dropped."""

    sha256: str | None = None
    dropped: int | None = None

    @property
    def rules(self) -> list[CleaningRule]:
        return self.parts(CleaningRule, "rules")


@dataclass(frozen=True)
class SplitSettings(Record):
    """`data.splits` as the snapshot used it (shares of each split, seed)."""

    train: float | None = None
    validation: float | None = None
    test: float | None = None
    seed: int | None = None
    stratify: bool | str | None = None  # true, false or "target_kind"


@dataclass(frozen=True)
class DataSplits(Record):
    """How rows were split: by the source's column or by hash of the split key."""

    method: str = ""  # column | hash
    sha256: str | None = None
    moved_to_cover_small_categories: list[dict[str, Any]] | None = None

    @property
    def settings(self) -> SplitSettings:
        return self.part(SplitSettings, "config") or SplitSettings(
            self.path, {}, where=self._at("config")
        )

    def check_parts(self) -> None:
        _ = self.settings


@dataclass(frozen=True)
class DedupSettings(Record):
    """`data.dedup` as the snapshot used it."""

    exact: bool | None = None
    near: bool | None = None
    threshold: float | None = None
    num_perm: int | None = None
    shingle_size: int | None = None
    policy: str | None = None


@dataclass(frozen=True)
class DataDedup(Record):
    """The duplicate search: its settings, policy and the algorithm's own parameters."""

    policy: str | None = None
    sha256: str | None = None
    normalization: str | None = None
    shingle_normalization: str | None = None
    algorithm: dict[str, Any] | None = None  # text: MinHash LSH; images: dHash (`image_hash`)

    @property
    def settings(self) -> DedupSettings:
        return self.part(DedupSettings, "config") or DedupSettings(
            self.path, {}, where=self._at("config")
        )

    @property
    def images(self) -> bool:
        """Whether the search compared images (perceptual hashes) rather than texts."""
        return "image_hash" in (self.algorithm or {})

    @property
    def max_hamming_distance(self) -> int | None:
        """An image search's bound: bits (of 64) two near-duplicate hashes may differ in."""
        return (self.algorithm or {}).get("max_hamming_distance")

    def check_parts(self) -> None:
        _ = self.settings


@dataclass(frozen=True)
class DataCounts(Record):
    """Rows at each step, and examples per split and category before and after dedup."""

    rows_read: int | None = None
    dropped_by_cleaning: int | None = None
    sampled_out: int | None = None
    removed_as_duplicates: int | None = None
    before_dedup: dict[str, dict[str, int]] | None = None  # split -> category -> examples
    final: dict[str, int] | None = None  # split -> examples
    per_category: dict[str, dict[str, int]] | None = None  # split -> category -> examples


@dataclass(frozen=True)
class DuplicateSummary(Record):
    """The pairs the duplicate search found and what the policy removed."""

    exact_pairs: int = 0
    near_pairs: int = 0
    within_split_pairs: int | None = None
    across_split_pairs: int | None = None
    pairs_by_split: dict[str, int] | None = None  # "train-validation" -> pairs
    rows_involved: int | None = None
    label_conflicts: int | None = None
    removed: int | None = None
    removed_by_split: dict[str, int] | None = None

    def figures(self) -> list[tuple[str, Any]]:
        """Every single figure of the summary as written, in its order (no tables)."""
        return [(k, v) for k, v in self.raw.items() if not isinstance(v, list | dict)]

    def by_split(self, within: bool) -> dict[str, int]:
        """The pairs within one split (`within`), or across two, by split pair."""
        pairs = self.pairs_by_split or {}
        return {k: v for k, v in pairs.items() if (k.split("-")[0] == k.split("-")[1]) == within}


@dataclass(frozen=True)
class DuplicatePair(Record):
    """Two rows the duplicate search found alike, their splits and labels."""

    a: str | int = ""
    b: str | int = ""
    split_a: str = ""
    split_b: str = ""
    kind: str | None = None  # exact | near
    similarity: float = 0.0  # Jaccard of shingles (texts) or hash similarity (images)
    label_a: str | None = None
    label_b: str | None = None

    @property
    def splits(self) -> str:
        """Its split, or both splits `a-b` when the pair crosses two."""
        return self.split_a if self.split_a == self.split_b else f"{self.split_a}-{self.split_b}"


@dataclass(frozen=True)
class Duplicates(Record):
    """records/data/<snapshot>/duplicates.json: every pair found and every row removed."""

    policy: str | None = None
    threshold: float | None = None
    removed: list[dict[str, Any]] | None = None  # {id, split, duplicate_of, kind, similarity}

    @property
    def pairs(self) -> list[DuplicatePair]:
        return self.parts(DuplicatePair, "pairs")

    @property
    def summary(self) -> DuplicateSummary | None:
        return self.part(DuplicateSummary, "summary")

    def check_parts(self) -> None:
        _ = self.pairs, self.summary


@dataclass(frozen=True)
class DataManifest(Record):
    """records/data/<snapshot>/manifest.json: a sealed snapshot and how it was made."""

    # the pieces a manifest always has, read when it is read (and checked then)
    PARTS: ClassVar = ("source", "cleaning", "splits", "dedup", "counts", "duplicates")

    snapshot_id: str = ""
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    format_version: int | None = None
    created_at: str | None = None
    fields: dict[str, Any] | None = None  # data.fields as used
    task_labels: list[str] | None = None
    labels: list[str] | None = None  # the label set (None for unlabelled data)
    transforms: dict[str, Any] | None = None
    notes: list[str] | None = None
    content_sha256: str | None = None
    unchanged: bool | None = None  # only in what `stages.data.stage.run` returns

    @property
    def source(self) -> DataSource:
        return self._piece(DataSource, "source")

    @property
    def cleaning(self) -> DataCleaning:
        return self._piece(DataCleaning, "cleaning")

    @property
    def splits(self) -> DataSplits:
        return self._piece(DataSplits, "splits")

    @property
    def dedup(self) -> DataDedup:
        return self._piece(DataDedup, "dedup")

    @property
    def counts(self) -> DataCounts:
        return self._piece(DataCounts, "counts")

    @property
    def duplicates(self) -> DuplicateSummary:
        return self._piece(DuplicateSummary, "duplicates")

    def _piece(self, cls: type[Any], name: str) -> Any:
        """The piece `name`, empty when an older manifest lacks it."""
        return self.part(cls, name) or cls(self.path, {}, where=self._at(name))

    def check_parts(self) -> None:
        for name in self.PARTS:
            piece = getattr(self, name)
            piece.check_parts()
        _ = self.cleaning.rules
