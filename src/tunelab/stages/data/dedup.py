"""Exact and near-duplicate detection: normalization, word shingles, MinHash, LSH, exact Jaccard.

Pure logic on values (lists of texts in, numpy arrays out); no disk. Vectorized with numpy and
pyarrow so that a million short documents take seconds, not minutes:

- normalize: NFKC, lower case, runs of whitespace to one space (pyarrow compute kernels).
- exact duplicates: equal normalized texts (pyarrow dictionary encoding).
- near duplicates: word shingles, MinHash, LSH, every candidate verified by its exact Jaccard
  similarity (`tunelab.stages.data.minhash`), so no reported pair is below the threshold.
- pairs across splits, the policy applied, the summary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunelab.core.progress import Progress, silent
from tunelab.stages.data.minhash import (
    NearDuplicates,
    jaccard,
    lsh_candidates,
    lsh_params,
    minhash_signatures,
    shingle_texts,
)

DEDUP_ALGORITHM_VERSION = 1


# ---------------------------------------------------------------- normalization and exact


def normalize_texts(texts: Sequence[str] | pa.Array) -> pa.Array:
    """NFKC, lower case, whitespace runs collapsed to one space, trimmed. Returns a string array."""
    arr = texts if isinstance(texts, pa.Array | pa.ChunkedArray) else pa.array(texts, pa.string())
    arr = pc.utf8_lower(pc.utf8_normalize(arr, form="NFKC"))
    words = pc.utf8_split_whitespace(arr)
    joined = pc.binary_join(words, " ")
    return pc.utf8_trim_whitespace(joined)


# Before shingling (near duplicates only): every punctuation mark and symbol (Unicode classes P
# and S, so curly quotes and dashes of any kind too) becomes a space, so two copies of a text
# that differ only in punctuation or quote characters share their word shingles.
SHINGLE_NORMALIZATION = "punctuation and symbols (Unicode P, S) to spaces, whitespace collapsed"


def strip_punctuation(normalized: pa.Array | Sequence[str]) -> pa.Array:
    """`normalize_texts` output with punctuation and symbols replaced by spaces."""
    arr = (
        normalized
        if isinstance(normalized, pa.Array | pa.ChunkedArray)
        else pa.array(normalized, pa.string())
    )
    spaced = pc.replace_substring_regex(arr, pattern=r"[\p{P}\p{S}]+", replacement=" ")
    return pc.utf8_trim_whitespace(pc.binary_join(pc.utf8_split_whitespace(spaced), " "))


def exact_group_ids(normalized: pa.Array | Sequence[str]) -> np.ndarray:
    """Group id per text: equal normalized texts share an id (ids in order of first appearance)."""
    arr = normalized if isinstance(normalized, pa.Array) else pa.array(normalized, pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    encoded = pc.dictionary_encode(arr)
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def find_near_duplicates(
    normalized: pa.Array | Sequence[str],
    *,
    threshold: float = 0.8,
    num_perm: int = 128,
    shingle_size: int = 5,
    seed: int = 1,
    num_threads: int | None = None,
    progress: Progress = silent,
) -> NearDuplicates:
    """Pairs of texts whose word-shingle sets (punctuation stripped first) have Jaccard
    similarity >= threshold."""
    sh = shingle_texts(strip_punctuation(normalized), shingle_size)
    progress("shingles", 1.0, 1.0)
    sig = minhash_signatures(sh, num_perm, seed, num_threads=num_threads, progress=progress)
    bands, rows = lsh_params(threshold, num_perm)
    active = np.flatnonzero(sh.counts > 0)
    cand = lsh_candidates(sig, bands, rows, active)
    progress("lsh", 1.0, 1.0)
    sim = jaccard(sh, cand)
    keep = sim >= threshold - 1e-12
    progress("verify", 1.0, 1.0)
    return NearDuplicates(cand[keep], sim[keep], len(cand), bands, rows)


# ---------------------------------------------------------------- pairs across splits and policy

# Exact groups above this size are reported as a star around their first member.
MAX_GROUP_ALL_PAIRS = 50
SPLIT_RANK = {"train": 0, "validation": 1, "test": 2}


@dataclass
class DuplicatePair:
    a: int  # row index
    b: int
    kind: str  # "exact" | "near"
    similarity: float


def find_duplicates(
    normalized: pa.Array | Sequence[str],
    *,
    exact: bool = True,
    near: bool = True,
    threshold: float = 0.8,
    num_perm: int = 128,
    shingle_size: int = 5,
    seed: int = 1,
    progress: Progress = silent,
) -> tuple[list[DuplicatePair], dict[str, int]]:
    """Exact pairs (equal normalized text) and near pairs (exact Jaccard >= threshold) among
    the rows. Near-duplicate search runs on one representative per exact group. Returns the
    pairs (row indices a < b) and the LSH layout used."""
    arr = normalized if isinstance(normalized, pa.Array) else pa.array(normalized, pa.string())
    n = len(arr)
    groups = exact_group_ids(arr) if exact else np.arange(n, dtype=np.int64)
    order = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.r_[True, groups[order][1:] != groups[order][:-1], True])
    members = [order[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    pairs: list[DuplicatePair] = []
    for m in members:
        if len(m) < 2:
            continue
        if len(m) <= MAX_GROUP_ALL_PAIRS:
            pairs += [
                DuplicatePair(int(m[i]), int(m[j]), "exact", 1.0)
                for i in range(len(m))
                for j in range(i + 1, len(m))
            ]
        else:
            pairs += [DuplicatePair(int(m[0]), int(x), "exact", 1.0) for x in m[1:]]
    info = {"bands": 0, "rows": 0, "candidates": 0, "representatives": len(members)}
    if near and n > 1:
        reps = np.array([m[0] for m in members], dtype=np.int64)
        rep_texts = arr.take(pa.array(reps))
        found = find_near_duplicates(
            rep_texts,
            threshold=threshold,
            num_perm=num_perm,
            shingle_size=shingle_size,
            seed=seed,
            progress=progress,
        )
        info.update(bands=found.bands, rows=found.rows, candidates=found.num_candidates)
        for (gi, gj), sim in zip(found.pairs.tolist(), found.similarity.tolist(), strict=True):
            mi, mj = members[gi], members[gj]
            if len(mi) * len(mj) > MAX_GROUP_ALL_PAIRS**2:
                mi, mj = mi[:1], mj[:1]
            for x in mi.tolist():
                for y in mj.tolist():
                    pairs.append(DuplicatePair(min(x, y), max(x, y), "near", float(sim)))
    pairs.sort(key=lambda p: (p.a, p.b))
    return pairs, info


def apply_policy(
    pairs: list[DuplicatePair], splits: Sequence[str], policy: str
) -> dict[int, tuple[int, DuplicatePair | None]]:
    """Rows to remove: {row: (the row it duplicates, the pair linking them or None)}.

    drop_eval: a validation or test row paired with a training row leaves its split.
    drop_all_but_one: in every group of rows linked by pairs, one row stays (training first,
        then validation, then test; the earliest row within a split).
    report_only: nothing is removed.
    """
    removed: dict[int, tuple[int, DuplicatePair | None]] = {}
    if policy == "report_only":
        return removed
    if policy == "drop_eval":
        for p in pairs:
            for keep, drop in ((p.a, p.b), (p.b, p.a)):
                if splits[keep] == "train" and splits[drop] != "train":
                    best = removed.get(drop)
                    if best is None or (best[1] is not None and p.similarity > best[1].similarity):
                        removed[drop] = (keep, p)
        return removed
    if policy == "drop_all_but_one":
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            parent.setdefault(x, x)
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for p in pairs:
            ra, rb = find(p.a), find(p.b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        clusters: dict[int, list[int]] = {}
        for x in list(parent):
            clusters.setdefault(find(x), []).append(x)
        direct: dict[tuple[int, int], DuplicatePair] = {(p.a, p.b): p for p in pairs}
        for rows in clusters.values():
            keeper = min(rows, key=lambda r: (SPLIT_RANK[splits[r]], r))
            for r in rows:
                if r != keeper:
                    removed[r] = (keeper, direct.get((min(r, keeper), max(r, keeper))))
        return removed
    raise ValueError(f"unknown duplicate policy {policy!r}")


def summarize(
    pairs: list[DuplicatePair], splits: Sequence[str], labels: Sequence[str | None]
) -> dict[str, object]:
    """Counts of pairs by kind and by split pair, rows involved, and exact pairs whose labels
    disagree."""
    by_splits: dict[str, int] = {}
    kinds = {"exact": 0, "near": 0}
    within = across = conflicts = 0
    rows: set[int] = set()
    for p in pairs:
        sa, sb = sorted((splits[p.a], splits[p.b]), key=SPLIT_RANK.__getitem__)
        by_splits[f"{sa}-{sb}"] = by_splits.get(f"{sa}-{sb}", 0) + 1
        kinds[p.kind] += 1
        if sa == sb:
            within += 1
        else:
            across += 1
        if labels[p.a] != labels[p.b]:
            conflicts += 1
        rows.update((p.a, p.b))
    return {
        "exact_pairs": kinds["exact"],
        "near_pairs": kinds["near"],
        "within_split_pairs": within,
        "across_split_pairs": across,
        "pairs_by_split": dict(sorted(by_splits.items())),
        "rows_involved": len(rows),
        "label_conflicts": conflicts,
    }


def label_conflict_groups(pairs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Groups of rows linked by duplicate pairs (duplicates.json rows) whose labels disagree,
    worst first (most rows, then highest similarity): each {"rows": {id: label}, "labels":
    {label: count}, "similarity": the highest in the group}."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    conflicting = [p for p in pairs if p.get("label_a") != p.get("label_b")]
    for p in conflicting:
        parent[find(p["a"])] = find(p["b"])
    groups: dict[str, dict[str, Any]] = {}
    for p in conflicting:
        g = groups.setdefault(find(p["a"]), {"rows": {}, "similarity": 0.0})
        g["rows"].update({p["a"]: p.get("label_a"), p["b"]: p.get("label_b")})
        g["similarity"] = max(g["similarity"], float(p["similarity"]))
    out = []
    for g in groups.values():
        counts: dict[str, int] = {}
        for label in g["rows"].values():
            counts[str(label)] = counts.get(str(label), 0) + 1
        out.append({**g, "labels": dict(sorted(counts.items(), key=lambda kv: -kv[1]))})
    return sorted(out, key=lambda g: (-len(g["rows"]), -g["similarity"], min(g["rows"])))
