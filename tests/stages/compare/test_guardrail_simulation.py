"""Guardrails on interval bounds against the point rule, over many simulated evaluation splits.

Ten categories; a "bad" variant truly loses 0.05 F1 on one of them, a "good" one loses nothing.
The rule is `f1 every_category >= -0.02 relative_to baseline`. The bootstrap is drawn for many
splits at once (index counts, the multinomial law of `resample_counts`) and each split is judged
by the code compare runs (`check_guardrails` then `judge_guardrails`, Holm by default).
"""

from __future__ import annotations

import numpy as np
import pytest

from tunelab.lib.statistics import Estimate
from tunelab.stages.compare.guardrails import check_guardrails, judge_guardrails, overall_verdict

C, N, SPLITS, SAMPLES, CHUNK = 10, 600, 400, 300, 20
ACCURACY, KEEP = 0.8, 0.5  # each example right w.p. 0.8; the variant keeps the baseline's
# verdict on half the examples and draws afresh on the rest (correlated errors)
RULE = {"metric": "f1", "scope": "every_category", "op": ">=", "value": -0.02}
RULE |= {"relative_to": "baseline"}
LABELS = [f"c{i}" for i in range(C)]


def _predict(rng, gold, correct):
    """A prediction per example: the gold label when correct, else another label at random."""
    other = (gold + rng.integers(1, C, size=gold.shape)) % C
    return np.where(correct, gold, other)


def _draw(rng, shape, bad_accuracy):
    gold = rng.integers(0, C, size=shape)
    base_ok = rng.uniform(size=shape) < ACCURACY
    acc = np.where(gold == 0, bad_accuracy, ACCURACY)
    fresh = rng.uniform(size=shape) < acc
    # where the variant's accuracy differs from the baseline's it draws afresh on every example
    keep = (rng.uniform(size=shape) < KEEP) & (acc == ACCURACY)
    var_ok = np.where(keep, base_ok, fresh)
    return gold, _predict(rng, gold, base_ok), _predict(rng, gold, var_ok)


def _f1(w, gold, pred):
    """Per-category F1 [..., C] of weighted examples: w [..., n], gold/pred [..., n]."""
    g = np.eye(C)[gold]  # [..., n, C]
    p = np.eye(C)[pred]
    tp = np.einsum("...n,...nc->...c", w, g * p)
    support, predicted = np.einsum("...n,...nc->...c", w, g), np.einsum("...n,...nc->...c", w, p)
    return np.divide(
        2 * tp, support + predicted, out=np.zeros_like(tp), where=support + predicted > 0
    )


def _true_delta(bad_accuracy):
    rng = np.random.default_rng(99)
    gold, base, var = _draw(rng, (400_000,), bad_accuracy)
    ones = np.ones(gold.shape)
    return _f1(ones, gold, var) - _f1(ones, gold, base)


def _bad_accuracy():
    """The category-0 accuracy at which its F1 truly drops by 0.05."""
    lo, hi = 0.5, ACCURACY
    for _ in range(18):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _true_delta(mid)[0] < -0.05 else (lo, mid)
    return (lo + hi) / 2


def _rates(bad_accuracy, seed):
    """Shares of splits: the interval rule passes, fails (Holm), fails (no adjustment); the
    point rule passes; category 0 passes under each rule."""
    rng = np.random.default_rng(seed)
    counts = dict.fromkeys(("pass", "fail", "fail_unadjusted", "point_pass", "c0", "c0_point"), 0)
    for _ in range(SPLITS // CHUNK):
        gold, base, var = _draw(rng, (CHUNK, N), bad_accuracy)
        idx = rng.integers(0, N, size=(CHUNK, SAMPLES, N)) + N * np.arange(CHUNK * SAMPLES).reshape(
            CHUNK, SAMPLES, 1
        )
        w = np.bincount(idx.ravel(), minlength=CHUNK * SAMPLES * N).reshape(CHUNK, SAMPLES, N)
        w = w.astype(np.float64)
        draws = _f1(w, gold[:, None], var[:, None]) - _f1(w, gold[:, None], base[:, None])
        ones = np.ones((CHUNK, N))
        b_point, v_point = _f1(ones, gold, base), _f1(ones, gold, var)
        for s in range(CHUNK):
            items = check_guardrails(
                [RULE],
                {"per_category": {c: {"f1": b_point[s, j]} for j, c in enumerate(LABELS)}},
                {"per_category": {c: {"f1": v_point[s, j]} for j, c in enumerate(LABELS)}},
            )

            delta, d = v_point[s] - b_point[s], draws[s]

            def estimate_of(metric, scope, item, relative, delta=delta, d=d):
                j = LABELS.index(item)
                return Estimate(point=delta[j], draws=d[:, j])

            holm = judge_guardrails(items, estimate_of, n=N, multiplicity="holm")
            none = judge_guardrails(items, estimate_of, n=N, multiplicity="none")
            counts["pass"] += overall_verdict(holm) == "pass"
            counts["fail"] += overall_verdict(holm) == "fail"
            counts["fail_unadjusted"] += overall_verdict(none) == "fail"
            counts["point_pass"] += all(it["pass"] for it in items)
            counts["c0"] += holm[0]["verdict"] == "pass"
            counts["c0_point"] += items[0]["pass"]
    return {k: v / SPLITS for k, v in counts.items()}


@pytest.mark.slow  # thousands of simulated splits (about 25 s)
def test_interval_rule_against_the_point_rule_over_simulated_splits():
    bad_accuracy = _bad_accuracy()
    bad_truth, good_truth = _true_delta(bad_accuracy), _true_delta(ACCURACY)
    assert bad_truth[0] == pytest.approx(-0.05, abs=0.002)
    assert min(bad_truth[1:]) > -0.02 and np.abs(good_truth).max() < 0.006

    bad, good = _rates(bad_accuracy, seed=1), _rates(ACCURACY, seed=2)
    print(
        f"\nbad variant (category 0 truly -0.05 F1), share of {SPLITS} splits passed: "
        f"interval rule {bad['pass']:.3f}, point rule {bad['point_pass']:.3f}; its category 0 "
        f"passed: interval rule {bad['c0']:.3f}, point rule {bad['c0_point']:.3f}"
        f"\ngood variant (no loss), share of {SPLITS} splits failed: interval rule with Holm "
        f"{good['fail']:.3f}, without adjustment {good['fail_unadjusted']:.3f}, "
        f"point rule {1 - good['point_pass']:.3f}"
    )
    assert bad["pass"] <= 0.05
    assert good["fail"] <= 0.05
    # the point rule is the luck of the draw: it passes the lost category and fails the good
    # variant far more often
    assert bad["c0"] <= 0.05 and bad["c0_point"] > 3 * max(bad["c0"], 0.01)
    assert 1 - good["point_pass"] > 3 * max(good["fail"], 0.01)
