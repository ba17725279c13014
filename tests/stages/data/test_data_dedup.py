"""Duplicates: normalization, shingles, exact Jaccard, MinHash/LSH recall and precision, policies;
and the real BBC corpus, which contains duplicate articles."""

from __future__ import annotations

import json
import random
import unicodedata
from itertools import combinations

import numpy as np
import pytest

from helpers import MINIMAL_HYPOTHESIS
from helpers.study import build_study
from tunelab.core.study import Study
from tunelab.stages.data import dedup as d
from tunelab.stages.data import load_snapshot, open_test_split
from tunelab.stages.data import minhash as mh
from tunelab.stages.data import stage as data_stage


def shingle_set(text: str, k: int) -> set[tuple[str, ...]]:
    # as the snapshot shingles: NFKC, lower case, punctuation and symbols (Unicode P, S) to spaces
    text = unicodedata.normalize("NFKC", text).lower()
    words = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text).split()
    if not words:
        return set()
    if len(words) < k:
        return {tuple(words)}
    return {tuple(words[i : i + k]) for i in range(len(words) - k + 1)}


def true_jaccard(a: str, b: str, k: int) -> float:
    sa, sb = shingle_set(a, k), shingle_set(b, k)
    return len(sa & sb) / len(sa | sb) if sa | sb else 0.0


def corpus(n: int, seed: int = 0, vocab: int = 2000) -> list[str]:
    rnd = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    return [" ".join(rnd.choice(words) for _ in range(rnd.randint(25, 60))) for _ in range(n)]


def mutate(text: str, rnd: random.Random, edits: int) -> str:
    w = text.split()
    for _ in range(edits):
        op = rnd.choice(["sub", "del", "ins", "end"])
        i = rnd.randrange(len(w))
        if op == "sub":
            w[i] = f"x{rnd.randrange(10**6)}"
        elif op == "del" and len(w) > 5:
            del w[i]
        elif op == "ins":
            w.insert(i, f"y{rnd.randrange(10**6)}")
        else:
            w.append(f"z{rnd.randrange(10**6)}")
    return " ".join(w)


def test_normalization_and_exact_groups():
    texts = ["Hello  World", "hello world", "ﬁne\u00a0print", "fine print", "", "other"]
    norm = d.normalize_texts(texts).to_pylist()
    assert norm == ["hello world", "hello world", "fine print", "fine print", "", "other"]
    g = d.exact_group_ids(norm).tolist()
    assert g[0] == g[1] and g[2] == g[3] and len({g[0], g[2], g[4], g[5]}) == 4


def test_shingle_sets_and_exact_jaccard_match_a_plain_python_reference():
    texts = corpus(120, vocab=40) + ["a b", "one", ""]
    texts += [mutate(t, random.Random(i), 2) for i, t in enumerate(texts[:40])]
    norm = d.normalize_texts(texts)
    for k in (1, 3, 5):
        sh = mh.shingle_texts(norm, k)
        counts = sh.counts
        for i, t in enumerate(texts):
            words = t.split()
            expected = 0 if not words else max(len(words) - k + 1, 1)
            assert counts[i] == expected
        pairs = np.array(
            list(combinations(range(0, len(texts), 7), 2)) + [(i, 123 + i) for i in range(40)]
        )
        got = mh.jaccard(sh, pairs)
        ref = [true_jaccard(texts[i], texts[j], k) for i, j in pairs]
        np.testing.assert_allclose(got, ref, atol=1e-12)


def test_lsh_layout_puts_threshold_pairs_in_candidates():
    for threshold in (0.5, 0.7, 0.8, 0.9):
        bands, rows = mh.lsh_params(threshold, 128)
        assert bands * rows <= 128
        assert mh.candidate_probability(threshold, bands, rows) >= mh.TARGET_CANDIDATE_PROBABILITY
        # the most selective layout that still meets the target
        assert (
            mh.candidate_probability(threshold, 128 // (rows + 1), rows + 1)
            < mh.TARGET_CANDIDATE_PROBABILITY
        )


def test_minhash_estimates_jaccard_and_is_deterministic():
    base = corpus(300, seed=1)
    rnd = random.Random(5)
    texts = base + [mutate(t, rnd, 3) for t in base]
    sh = mh.shingle_texts(d.normalize_texts(texts), 5)
    sig = mh.minhash_signatures(sh, 256, seed=1, num_threads=2)
    again = mh.minhash_signatures(sh, 256, seed=1, num_threads=1)
    assert np.array_equal(sig, again)
    est = (sig[:300] == sig[300:]).mean(axis=1)
    truth = np.array([true_jaccard(a, b, 5) for a, b in zip(base, texts[300:], strict=True)])
    assert np.abs(est - truth).mean() < 0.03


def test_near_duplicates_recall_and_no_pair_below_threshold():
    rnd = random.Random(7)
    base = corpus(3000, seed=2)
    copies = [mutate(base[i], rnd, rnd.randint(1, 4)) for i in range(0, 3000, 10)]
    texts = base + copies
    truth = {
        (i * 10, 3000 + c): true_jaccard(base[i * 10], copies[c], 5)
        for c, i in enumerate(range(len(copies)))
    }
    positives = {p for p, j in truth.items() if j >= 0.8}
    assert len(positives) > 50
    found = d.find_near_duplicates(d.normalize_texts(texts), threshold=0.8)
    pairs = {tuple(p) for p in found.pairs.tolist()}
    recall = len(pairs & positives) / len(positives)
    assert recall >= 0.97
    for (i, j), sim in zip(found.pairs.tolist(), found.similarity.tolist(), strict=True):
        assert sim >= 0.8
        assert sim == pytest.approx(true_jaccard(texts[i], texts[j], 5))


def test_find_duplicates_exact_groups_and_near_pairs_between_them():
    a = " ".join(f"alpha{i}" for i in range(80))
    b = a.replace("alpha20", "beta")  # near a
    texts = [a, a.upper(), b, "unrelated words here for sure", b + "  "]
    pairs, info = d.find_duplicates(d.normalize_texts(texts), threshold=0.8)
    got = {(p.a, p.b, p.kind) for p in pairs}
    assert got == {
        (0, 1, "exact"),
        (2, 4, "exact"),
        (0, 2, "near"),
        (0, 4, "near"),
        (1, 2, "near"),
        (1, 4, "near"),
    }
    assert info["representatives"] == 3


def test_policies_on_pairs():
    P = d.DuplicatePair
    splits = ["train", "validation", "test", "train", "validation", "test"]
    pairs = [
        P(0, 1, "exact", 1.0),
        P(1, 2, "near", 0.9),
        P(3, 5, "near", 0.85),
        P(4, 5, "near", 0.95),
    ]
    assert d.apply_policy(pairs, splits, "report_only") == {}
    drop_eval = d.apply_policy(pairs, splits, "drop_eval")
    assert {k: v[0] for k, v in drop_eval.items()} == {1: 0, 5: 3}
    all_but_one = d.apply_policy(pairs, splits, "drop_all_but_one")
    assert {k: v[0] for k, v in all_but_one.items()} == {1: 0, 2: 0, 4: 3, 5: 3}
    s = d.summarize(pairs, splits, ["x"] * 6)
    assert s["across_split_pairs"] == 4 and s["within_split_pairs"] == 0
    assert s["pairs_by_split"] == {"train-validation": 1, "validation-test": 2, "train-test": 1}


def test_empty_and_tiny_inputs():
    found = d.find_near_duplicates(d.normalize_texts(["", "", "a"]), threshold=0.8)
    assert len(found.pairs) == 0
    pairs, _ = d.find_duplicates(d.normalize_texts(["only one"]))
    assert pairs == []


# ---------------------------------------------------------------- the real BBC corpus


@pytest.mark.slow
def test_bbc_snapshot_finds_the_duplicates_it_really_contains(tmp_path, bbc_dir):
    root = build_study(
        tmp_path / "bbc",
        template=False,
        name="bbc",
        hypothesis={**MINIMAL_HYPOTHESIS, "behaviour": "route BBC articles"},
        model_dir="unused",
        guardrails=[],
        data={
            # sports/199.txt holds one latin-1 byte: replace it rather than refuse the corpus
            "source": {"format": "folder", "path": str(bbc_dir), "encoding_errors": "replace"},
            "cleaning": [{"rule": "unicode_nfc"}, {"rule": "normalize_whitespace"}],
        },
    )
    s = Study.open(root)
    m = data_stage.run(s)
    assert m["counts"]["rows_read"] == 2225
    assert m["labels"] == ["business", "entertainment", "politics", "sports", "tech"]
    dup = m["duplicates"]
    assert dup["exact_pairs"] >= 50 and dup["near_pairs"] >= 20
    assert dup["across_split_pairs"] > 0 and dup["removed"] > 0
    assert m["source"]["replaced_invalid_utf8_bytes"] == 1

    snap = load_snapshot(s)
    report = json.loads((snap.dir / "duplicates.json").read_text())
    removed = {r["id"] for r in report["removed"]}
    assert len(removed) == dup["removed"]
    # drop_eval: no validation/test row left that duplicates a training row
    evaluation = {r["id"] for r in snap.rows("validation")}
    evaluation |= {r["id"] for r in open_test_split(s, snap, who="pytest", why="bbc check")}
    assert not removed & evaluation
    for p in report["pairs"]:
        if "train" in (p["split_a"], p["split_b"]) and p["split_a"] != p["split_b"]:
            other = p["b"] if p["split_a"] == "train" else p["a"]
            assert other in removed and other not in evaluation
    # a real near duplicate pair, checked against the files themselves
    near = max((p for p in report["pairs"] if p["kind"] == "near"), key=lambda p: p["similarity"])
    a = (bbc_dir / near["a"]).read_bytes().decode("utf-8", "replace")
    b = (bbc_dir / near["b"]).read_bytes().decode("utf-8", "replace")
    assert true_jaccard(a, b, 5) == pytest.approx(near["similarity"], abs=1e-3)
