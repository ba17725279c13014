"""Near-duplicate detection at scale: tunelab's MinHash + LSH against datasketch's MinHashLSH.

Builds N short synthetic documents (20-60 words from a Zipf-like vocabulary), a fraction of
which are edited copies of others (words substituted, inserted, deleted, added at the ends).
The truth is every injected pair whose word-shingle Jaccard similarity is >= the threshold.
Both tools get the same texts, the same shingles (word 5-grams of the lower-cased text), the
same threshold and number of permutations; each is timed from the list of texts to the list of
pairs. Recall = found true pairs / true pairs; precision = found true pairs / pairs reported.

    python benchmarks/dedup_scale.py                       # 1,000,000 documents
    python benchmarks/dedup_scale.py --docs 100000 --threads 2

The last line reads `seconds=S recall=R precision=P speedup_vs_datasketch=X` (tunelab's wall
seconds, recall and precision; the speed-up in wall time). CPU seconds and the load average are
printed too: on a shared machine wall time depends on the neighbours.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tunelab.stages.data import dedup


def make_corpus(n: int, dup_fraction: float, seed: int) -> tuple[list[str], list[tuple[int, int]]]:
    """n documents; round(n * dup_fraction) of them are edited copies of earlier ones."""
    rng = np.random.default_rng(seed)
    num_copies = int(round(n * dup_fraction))
    num_base = n - num_copies
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    vocab_size = 50_000
    lengths = rng.integers(3, 11, vocab_size)
    raw = rng.choice(letters, int(lengths.sum()))
    cut = np.r_[0, np.cumsum(lengths)]
    vocab = pa.array(
        sorted({raw[cut[i] : cut[i + 1]].tobytes().decode() for i in range(vocab_size)})
    )
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 0.9
    weights /= weights.sum()
    num_words = rng.integers(20, 61, num_base)
    ids = rng.choice(len(vocab), size=int(num_words.sum()), p=weights)
    offsets = np.r_[0, np.cumsum(num_words)]
    words = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), vocab.take(pa.array(ids)))
    base = pc.binary_join(words, " ").to_pylist()

    rnd = random.Random(seed)
    sources = rnd.sample(range(num_base), num_copies)
    copies = []
    for src in sources:
        w = base[src].split()
        for _ in range(rnd.choice((1, 1, 2, 2, 3))):
            op = rnd.choice(("append", "prepend", "trim", "sub", "ins", "del"))
            new = vocab[rnd.randrange(len(vocab))].as_py()
            i = rnd.randrange(len(w))
            if op == "append":
                w.append(new)
            elif op == "prepend":
                w.insert(0, new)
            elif op == "trim":
                w.pop()
            elif op == "sub":
                w[i] = new
            elif op == "ins":
                w.insert(i, new)
            else:
                del w[i]
        copies.append(" ".join(w))
    # interleave the copies at random places
    order = list(range(n))
    rnd.shuffle(order)
    texts: list[str] = [""] * n
    for pos, doc in zip(order, base + copies, strict=True):
        texts[pos] = doc
    injected = [(order[src], order[num_base + c]) for c, src in enumerate(sources)]
    return texts, [(min(a, b), max(a, b)) for a, b in injected]


def shingles(text: str, k: int) -> list[str]:
    w = text.lower().split()
    if len(w) < k:
        return [" ".join(w)] if w else []
    return [" ".join(w[i : i + k]) for i in range(len(w) - k + 1)]


def jaccard(a: str, b: str, k: int) -> float:
    sa, sb = set(shingles(a, k)), set(shingles(b, k))
    return len(sa & sb) / len(sa | sb) if sa | sb else 0.0


def run_tunelab(texts: list[str], args: argparse.Namespace) -> tuple[float, float, set]:
    t0, c0 = time.perf_counter(), time.process_time()
    normalized = dedup.normalize_texts(texts)
    found = dedup.find_near_duplicates(
        normalized,
        threshold=args.threshold,
        num_perm=args.num_perm,
        shingle_size=args.shingle_size,
        num_threads=args.threads,
    )
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return seconds, cpu, {tuple(p) for p in found.pairs.tolist()}


def run_datasketch(texts: list[str], args: argparse.Namespace) -> tuple[float, float, set]:
    from datasketch import MinHash, MinHashLSH

    t0, c0 = time.perf_counter(), time.process_time()
    k = args.shingle_size
    sketches = MinHash.bulk(
        ([s.encode("utf-8") for s in shingles(t, k)] for t in texts), num_perm=args.num_perm
    )
    lsh = MinHashLSH(threshold=args.threshold, num_perm=args.num_perm)
    with lsh.insertion_session() as session:
        for i, m in enumerate(sketches):
            session.insert(i, m, check_duplication=False)
    pairs = set()
    for i, m in enumerate(sketches):
        for j in lsh.query(m):
            if j != i:
                pairs.add((min(i, j), max(i, j)))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"  datasketch layout: bands={lsh.b} rows={lsh.r}", flush=True)
    return seconds, cpu, pairs


def score(found: set, positives: set) -> tuple[float, float]:
    hit = len(found & positives)
    recall = hit / len(positives) if positives else 1.0
    precision = hit / len(found) if found else 1.0
    return recall, precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--dup-fraction", type=float, default=0.05)
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--shingle-size", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="tunelab's MinHash threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-datasketch", action="store_true")
    args = p.parse_args()

    print(
        f"dedup_scale: {args.docs:,} documents, {args.dup_fraction:.0%} edited copies, "
        f"Jaccard >= {args.threshold} on word {args.shingle_size}-shingles, "
        f"{args.num_perm} permutations; {os.cpu_count()} CPUs visible, "
        f"affinity {len(os.sched_getaffinity(0))}",
        flush=True,
    )
    t0 = time.perf_counter()
    texts, injected = make_corpus(args.docs, args.dup_fraction, args.seed)
    truth = {pair: jaccard(texts[pair[0]], texts[pair[1]], args.shingle_size) for pair in injected}
    positives = {pair for pair, j in truth.items() if j >= args.threshold}
    sims = np.array(list(truth.values()))
    print(
        f"  corpus built in {time.perf_counter() - t0:.1f}s: {len(injected):,} injected pairs, "
        f"{len(positives):,} at Jaccard >= {args.threshold} "
        f"(quartiles {np.percentile(sims, [25, 50, 75]).round(3).tolist()})",
        flush=True,
    )

    load = os.getloadavg()[0]
    ours_s, ours_cpu, ours = run_tunelab(texts, args)
    ours_r, ours_p = score(ours, positives)
    print(
        f"  tunelab    {ours_s:8.1f}s wall {ours_cpu:8.1f}s cpu  recall {ours_r:.4f}  "
        f"precision {ours_p:.4f}  pairs {len(ours):,}  (load average before: {load:.1f})",
        flush=True,
    )
    gc.collect()
    speedup = float("nan")
    if not args.skip_datasketch:
        load = os.getloadavg()[0]
        ds_s, ds_cpu, ds = run_datasketch(texts, args)
        ds_r, ds_p = score(ds, positives)
        speedup = ds_s / ours_s
        print(
            f"  datasketch {ds_s:8.1f}s wall {ds_cpu:8.1f}s cpu  recall {ds_r:.4f}  "
            f"precision {ds_p:.4f}  pairs {len(ds):,}  (load average before: {load:.1f})",
            flush=True,
        )
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"  peak RSS {peak_gb:.1f} GB, total {time.perf_counter() - t0:.0f}s", flush=True)
    print(
        f"seconds={ours_s:.1f} recall={ours_r:.4f} precision={ours_p:.4f} "
        f"speedup_vs_datasketch={speedup:.2f}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
