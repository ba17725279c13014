"""The near-duplicate search's arithmetic (pure: arrays in, arrays out): word shingles, MinHash, LSH
and the exact Jaccard similarity that verifies every candidate.

- shingles: every `k` consecutive words, hashed to 32 bits from per-word 64-bit hashes
  (blake2b of each distinct word, so hashes do not depend on row order or the process).
- MinHash: `num_perm` strongly universal hash functions h(x) = (a*x + b mod 2**64) >> 32 on the
  32-bit shingle hashes, minimum per document ([docs, num_perm] uint32).
- LSH: `bands` x `rows`; the band layout is chosen so that a pair AT the threshold becomes a
  candidate with probability >= 0.995, and every candidate is then verified by the exact
  Jaccard similarity of the two shingle sets, so no reported pair is below the threshold.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunelab.core.progress import Progress, silent

# Probability that a pair exactly at the threshold becomes an LSH candidate.
TARGET_CANDIDATE_PROBABILITY = 0.995
# Buckets holding more documents than this are linked by a sliding window (not every pair).
MAX_BUCKET_PAIRS_WINDOW = 64

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


# ---------------------------------------------------------------- shingles


def _word_hashes(words: pa.Array) -> np.ndarray:
    """64-bit hash per word: blake2b of each distinct word (order- and process-independent)."""
    encoded = pc.dictionary_encode(words)
    uniques = encoded.dictionary.to_pylist()
    table = np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
            for w in uniques
        ),
        dtype=np.uint64,
        count=len(uniques),
    )
    idx = encoded.indices.to_numpy(zero_copy_only=False)
    return table[idx] if len(idx) else np.zeros(0, np.uint64)


@dataclass
class Shingles:
    """Shingle hashes of every document: doc d owns values[offsets[d]:offsets[d+1]] (uint32)."""

    values: np.ndarray  # [total_shingles] uint32
    offsets: np.ndarray  # [num_docs + 1] int64

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)


def shingle_texts(normalized: pa.Array | Sequence[str], k: int) -> Shingles:
    """Word k-shingles of normalized texts (words separated by one space), hashed to uint32.

    A text with fewer than k words (but at least one) has one shingle: all its words. An empty
    text has none.
    """
    arr = normalized if isinstance(normalized, pa.Array) else pa.array(normalized, pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    lists = pc.split_pattern(arr, " ")
    list_len = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    empty = pc.equal(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False)
    flat = lists.flatten()
    if empty.any():  # an empty text splits into one empty word
        flat = flat.filter(pa.array(np.repeat(~empty, list_len)))
    num_words = np.where(empty, 0, list_len)
    words = _word_hashes(flat)  # [total_words] uint64
    word_start = np.zeros(n + 1, np.int64)
    np.cumsum(num_words, out=word_start[1:])

    num_sh = np.where(num_words >= k, num_words - k + 1, np.minimum(num_words, 1))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(num_sh, out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return Shingles(np.zeros(0, np.uint32), offsets)
    # Window hash at every word position of the flat word array (contiguous slices, no
    # gathers), then keep the windows that start a shingle: shingle s of doc d starts at word
    # word_start[d] + (s - offsets[d]).
    num_total = len(words)
    padded = np.concatenate([words, np.zeros(k, np.uint64)])
    window = padded[:num_total].copy()
    for t in range(1, k):
        window *= _GOLDEN
        window += padded[t : num_total + t]
    start = np.arange(total, dtype=np.int64)
    start += np.repeat(word_start[:-1] - offsets[:-1], num_sh)
    acc = window[start]
    # texts shorter than k words: their one shingle holds only their own words
    short = np.flatnonzero((num_words > 0) & (num_words < k))
    if len(short):
        st, length = word_start[short], num_words[short]
        sacc = words[st]
        for t in range(1, k):
            sacc = np.where(length > t, sacc * _GOLDEN + padded[st + t], sacc)
        acc[offsets[short]] = sacc
    values = (_mix64(acc) >> np.uint64(32)).astype(np.uint32)
    return Shingles(values, offsets)


# ---------------------------------------------------------------- MinHash and LSH


def _perm_params(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | np.uint64(1)  # odd
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def _padded_lengths(counts: np.ndarray) -> np.ndarray:
    """Round shingle counts up (at most 12.5 %) so documents fall into few length buckets."""
    c = np.maximum(counts, 1)
    step = 2 ** np.maximum(0, np.floor(np.log2(c)).astype(np.int64) - 3)
    return -(-c // step) * step


# elements of one [docs, padded_len, num_perm] uint64 block (2 MiB: stays in cache)
_BLOCK_ELEMENTS = 1 << 18


def minhash_signatures(
    shingles: Shingles,
    num_perm: int = 128,
    seed: int = 1,
    *,
    num_threads: int | None = None,
    progress: Progress = silent,
) -> np.ndarray:
    """[num_docs, num_perm] uint32 MinHash signatures; documents without shingles get all-max.

    h_i(x) = ((a_i * x + b_i) mod 2**64) >> 32 on 32-bit shingle hashes x (strongly universal).
    Documents are grouped by (padded) length so that each block is a dense
    [docs, length, num_perm] array reduced with one min over its length axis; padding repeats a
    document's last shingle, which cannot change its minimum. Blocks are spread over
    `num_threads` threads (numpy releases the GIL in its kernels).
    """
    counts = shingles.counts
    n = len(counts)
    sig = np.full((n, num_perm), np.iinfo(np.uint32).max, np.uint32)
    docs = np.flatnonzero(counts > 0)
    if len(docs) == 0:
        return sig
    a, b = _perm_params(num_perm, seed)
    offsets = shingles.offsets
    values = shingles.values.astype(np.uint64)
    padded = _padded_lengths(counts[docs])
    order = np.argsort(padded, kind="stable")
    docs, padded = docs[order], padded[order]
    blocks: list[tuple[np.ndarray, int]] = []
    edges = np.flatnonzero(np.r_[True, padded[1:] != padded[:-1], True])
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        length = int(padded[lo])
        per_block = max(1, _BLOCK_ELEMENTS // (length * num_perm))
        for s in range(lo, hi, per_block):
            blocks.append((docs[s : min(hi, s + per_block)], length))
    shift = np.uint64(32)
    seg = max(1, _BLOCK_ELEMENTS // num_perm)  # shingles per piece of a very long document
    done = [0]
    lock = threading.Lock()

    def run(block: tuple[np.ndarray, int]) -> None:
        chunk, length = block
        if length * num_perm <= _BLOCK_ELEMENTS:
            last = counts[chunk] - 1
            idx = offsets[chunk][:, None] + np.minimum(np.arange(length)[None, :], last[:, None])
            h = values[idx][:, :, None] * a  # [docs, length, num_perm]
            h += b
            sig[chunk] = (h.min(axis=1) >> shift).astype(np.uint32)
        else:  # one long document, in pieces
            (d,) = chunk
            best = np.full(num_perm, np.iinfo(np.uint64).max, np.uint64)
            for lo in range(int(offsets[d]), int(offsets[d + 1]), seg):
                h = values[lo : min(lo + seg, int(offsets[d + 1]))][:, None] * a
                h += b
                np.minimum(best, h.min(axis=0), out=best)
            sig[d] = (best >> shift).astype(np.uint32)
        with lock:
            done[0] += len(chunk)
            progress("minhash", done[0] / len(docs), 1.0)

    def run_many(part: list[tuple[np.ndarray, int]]) -> None:
        for block in part:
            run(block)

    threads = max(1, min(num_threads or os.cpu_count() or 1, 16, len(blocks)))
    if threads == 1:
        run_many(blocks)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run_many, [blocks[t::threads] for t in range(threads)]))
    return sig


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - similarity**rows) ** bands


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows): the most rows per band (fewest false candidates) that still makes a pair
    at `threshold` a candidate with probability >= TARGET_CANDIDATE_PROBABILITY."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= TARGET_CANDIDATE_PROBABILITY:
            best = (bands, rows)
    return best


def _band_keys(sig: np.ndarray, band: int, rows: int) -> np.ndarray:
    acc = np.full(len(sig), ((band + 1) * int(_GOLDEN)) & int(_MASK64), np.uint64)
    for c in range(band * rows, (band + 1) * rows):
        acc *= _GOLDEN
        acc += sig[:, c]
    return _mix64(acc)


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hash-based unique is slower on large integer arrays)."""
    if len(x) == 0:
        return x
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]]


def _bucket_pairs(keys: np.ndarray, members: np.ndarray) -> np.ndarray:
    """Pairs of members sharing a key. [P, 2] int64 with pair[:, 0] < pair[:, 1]."""
    sk = np.sort(keys)
    same = sk[1:] == sk[:-1]
    if not same.any():
        return np.zeros((0, 2), np.int64)
    shared = _sorted_unique(sk[1:][same])
    # only the (few) rows whose key is shared get sorted by key
    pos = np.minimum(np.searchsorted(shared, keys), len(shared) - 1)
    rows = np.flatnonzero(shared[pos] == keys)
    order = rows[np.argsort(keys[rows], kind="stable")]
    k = keys[order]
    m = members[order]
    run_id = np.cumsum(np.r_[True, k[1:] != k[:-1]]) - 1
    out = []
    for t in range(1, MAX_BUCKET_PAIRS_WINDOW):
        if t >= len(k):
            break
        same_run = run_id[t:] == run_id[:-t]
        if not same_run.any():
            break
        out.append(np.stack([m[:-t][same_run], m[t:][same_run]], axis=1))
    return np.sort(np.concatenate(out), axis=1)


def lsh_candidates(
    sig: np.ndarray, bands: int, rows: int, active: np.ndarray | None = None
) -> np.ndarray:
    """Candidate pairs [P, 2] (i < j, unique) sharing at least one band."""
    members = np.arange(len(sig), dtype=np.int64) if active is None else active
    s = sig if active is None else sig[active]
    found = [_bucket_pairs(_band_keys(s, band, rows), members) for band in range(bands)]
    pairs = np.concatenate(found) if found else np.zeros((0, 2), np.int64)
    if len(pairs) == 0:
        return pairs
    n = np.int64(len(sig))
    codes = _sorted_unique(pairs[:, 0] * n + pairs[:, 1])
    return np.stack([codes // n, codes % n], axis=1)


def jaccard(shingles: Shingles, pairs: np.ndarray, chunk_entries: int = 4_000_000) -> np.ndarray:
    """Exact Jaccard similarity of the shingle sets of each pair. [P] float64."""
    if len(pairs) == 0:
        return np.zeros(0)
    # Unique sorted shingle set of every document taking part.
    docs = _sorted_unique(pairs.ravel())
    local = np.full(len(shingles.counts), -1, np.int64)
    local[docs] = np.arange(len(docs))
    cnt = shingles.counts[docs]
    idx = np.repeat(shingles.offsets[docs], cnt) + (
        np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    )
    keys = (
        np.repeat(np.arange(len(docs), dtype=np.uint64), cnt) << np.uint64(32)
    ) | shingles.values[idx].astype(np.uint64)
    keys = _sorted_unique(keys)
    set_doc = (keys >> np.uint64(32)).astype(np.int64)
    set_val = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint64)
    set_cnt = np.bincount(set_doc, minlength=len(docs)).astype(np.int64)
    set_off = np.zeros(len(docs) + 1, np.int64)
    np.cumsum(set_cnt, out=set_off[1:])

    li, lj = local[pairs[:, 0]], local[pairs[:, 1]]
    size_i, size_j = set_cnt[li], set_cnt[lj]
    inter = np.zeros(len(pairs), np.int64)
    per_pair = size_i + size_j
    # chunks of pairs holding about chunk_entries shingles in all
    bounds = np.searchsorted(np.cumsum(per_pair), np.arange(0, per_pair.sum(), chunk_entries))
    bounds = np.unique(np.r_[bounds, len(pairs)])
    lo = 0
    for hi in bounds:
        if hi <= lo:
            continue
        p = np.arange(lo, hi)
        parts = []
        for side in (li[p], lj[p]):
            c = set_cnt[side]
            gather = np.repeat(set_off[side], c) + (
                np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
            )
            tag = np.repeat((p - lo).astype(np.uint64), c) << np.uint64(32)
            parts.append(tag | set_val[gather])
        both = np.sort(np.concatenate(parts))
        dup = both[1:] == both[:-1]
        pair_of_dup = (both[1:][dup] >> np.uint64(32)).astype(np.int64)
        inter[lo:hi] = np.bincount(pair_of_dup, minlength=hi - lo)
        lo = hi
    union = size_i + size_j - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / np.maximum(union, 1), 0.0)


@dataclass
class NearDuplicates:
    pairs: np.ndarray  # [P, 2] int64, i < j, indices into the input texts
    similarity: np.ndarray  # [P] float64 exact Jaccard, >= threshold
    num_candidates: int
    bands: int
    rows: int
