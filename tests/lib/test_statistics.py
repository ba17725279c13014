"""lib/statistics against references: statsmodels and scipy (tests only), and simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint
from statsmodels.stats.weightstats import ztost

from tunelab.lib.statistics import (
    Estimate,
    bootstrap_se,
    detectable_effect,
    examples_needed,
    examples_to_settle,
    holm,
    mcnemar,
    mean_stat,
    paired_se,
    rate_detectable_effect,
    step_down,
    summarize_draws,
    synthetic_predictions,
    tost_p_value,
    tost_verdict,
    wilson_interval,
)


@pytest.mark.parametrize(
    ("k", "n", "confidence"),
    [(0, 10, 0.95), (10, 10, 0.95), (7, 20, 0.95), (120, 127, 0.95), (3, 40, 0.9), (50, 99, 0.99)],
)
def test_wilson_matches_statsmodels(k, n, confidence):
    low, high = wilson_interval(k, n, confidence)
    ref = proportion_confint(k, n, alpha=1 - confidence, method="wilson")
    assert low == pytest.approx(ref[0], abs=1e-12) and high == pytest.approx(ref[1], abs=1e-12)


def test_wilson_bounds_and_score_p_values_agree():
    """A one-sided Wilson bound at level a clears a margin exactly when the score-test p-value
    of that margin is below a (the interval inverts the test)."""
    est = Estimate(point=118 / 127, successes=118, trials=127)
    alpha = 0.025
    for margin in np.linspace(0.80, 0.97, 35):
        assert (est.lower(alpha) > margin) == (est.p_above(margin) < alpha)
        assert (est.upper(alpha) < margin) == (est.p_below(margin) < alpha)


@pytest.mark.slow  # many random families against statsmodels (about 25 s)
def test_holm_matches_statsmodels():
    rng = np.random.default_rng(4)
    for _ in range(50):
        p = np.concatenate([rng.uniform(0, 0.02, 3), rng.uniform(0, 1, 7)])
        rejected, adjusted = holm(list(p), 0.05)
        ref_rej, ref_adj, _, _ = multipletests(p, alpha=0.05, method="holm")
        assert rejected == list(ref_rej)
        assert adjusted == pytest.approx(list(ref_adj), abs=1e-12)


def test_step_down_levels():
    p = [0.001, 0.04, 0.011, 0.3]
    out = step_down(p, 0.05, lambda i, a: p[i] <= a, "holm")
    # sorted: .001 at .05/4, .011 at .05/3, .04 at .05/2 fails: stop there
    assert out == [(True, 0.0125), (False, 0.025), (True, 0.05 / 3), (False, 0.025)]
    assert step_down(p, 0.05, lambda i, a: p[i] <= a, "bonferroni")[2] == (True, 0.0125)
    assert step_down(p, 0.05, lambda i, a: p[i] <= a, "none")[1] == (True, 0.05)


def test_tost_agrees_with_statsmodels_ztost():
    """The bootstrap TOST p-value of a paired mean delta is the z-test's (statsmodels ztost on
    the per-example differences) up to bootstrap noise."""
    rng = np.random.default_rng(1)
    n = 400
    base = rng.normal(0, 1, n)
    for shift, margin in ((0.0, 0.2), (0.05, 0.15), (0.15, 0.2), (0.3, 0.1)):
        var = base + shift + rng.normal(0, 0.8, n)
        _, draws = _mean_delta_draws(base, var, samples=10000)
        ours = tost_p_value(Estimate(point=float((var - base).mean()), draws=draws), margin)
        ref, _, _ = ztost(var - base, low=-margin, upp=margin)
        assert ours == pytest.approx(ref, abs=0.02)


def test_tost_verdicts():
    inside = Estimate(point=0.0, draws=np.linspace(-0.005, 0.005, 101))
    assert tost_verdict(inside, 0.01, 0.025)[0] == "equivalent"
    beyond = Estimate(point=0.05, draws=np.linspace(0.03, 0.07, 101))
    assert tost_verdict(beyond, 0.01, 0.025)[0] == "not equivalent"
    wide = Estimate(point=0.0, draws=np.linspace(-0.05, 0.05, 101))
    assert tost_verdict(wide, 0.01, 0.025)[0] == "inconclusive"


def _mean_delta_draws(base, var, samples=1000, seed=0):
    from tunelab.lib.statistics import paired_draws

    point, draws = paired_draws(
        {"m": (mean_stat(base), mean_stat(var))}, len(base), samples=samples, seed=seed
    )
    return point["m"], draws["m"]


def test_paired_bootstrap_coverage_by_simulation():
    """Over 2,000 simulated validation splits (paired correctness of two classifiers with
    correlated errors), the 95 % paired bootstrap interval of the accuracy delta covers the
    true delta in 95 +- 1.5 % of them. The resample counts are drawn for 100 splits at once
    (the multinomial law of `resample_counts`, drawn as index counts for speed); the intervals
    come from `summarize_draws`."""
    rng = np.random.default_rng(2026)
    n, splits, samples, chunk = 200, 2000, 400, 100
    p_base, p_var = 0.7, 0.75
    t_base, t_var = _quantile_of_mix(p_base), _quantile_of_mix(p_var)
    covered = 0
    for _ in range(splits // chunk):
        shared = rng.uniform(size=(chunk, n))  # example difficulty: both err on hard examples
        base = (0.6 * shared + 0.4 * rng.uniform(size=(chunk, n))) < t_base
        var = (0.6 * shared + 0.4 * rng.uniform(size=(chunk, n))) < t_var
        d = var.astype(float) - base  # [chunk, n]
        idx = rng.integers(0, n, size=(chunk, samples, n))
        offsets = (np.arange(chunk * samples) * n).reshape(chunk, samples, 1)
        w = np.bincount((idx + offsets).ravel(), minlength=chunk * samples * n)
        w = w.reshape(chunk, samples, n).astype(float)  # [chunk, samples, n]
        draws = np.einsum("sbn,sn->sb", w, d) / n  # [chunk, samples]
        for s in range(chunk):
            point = {"acc": (np.float64(0.0), np.float64(d[s].mean()))}
            out = summarize_draws(point, {"acc": draws[s]}, 0.95)["acc"]
            covered += out["ci_low"] <= p_var - p_base <= out["ci_high"]
    assert abs(covered / splits - 0.95) <= 0.015


def _quantile_of_mix(p: float) -> float:
    """The threshold t with P(0.6 U1 + 0.4 U2 < t) = p (the trapezoid's CDF, inverted)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        t = (lo + hi) / 2
        cdf = float(np.mean(_MIX < t))
        lo, hi = (t, hi) if cdf < p else (lo, t)
    return (lo + hi) / 2


_MIX = 0.6 * np.random.default_rng(0).uniform(size=400_000) + 0.4 * np.random.default_rng(
    1
).uniform(size=400_000)


@pytest.mark.parametrize("rate", [0.5, 0.7])
def test_detectable_effect_matches_a_simulated_power_curve(rate):
    """The detectable rise of a rate at 80 % power is where a simulated power curve of the
    paired test (interval of the delta above 0) crosses 0.8, within 10 %."""
    n, alpha, sims = 300, 0.025, 4000
    predicted = rate_detectable_effect(n, rate, alpha, 0.8)
    rng = np.random.default_rng(7)
    z = scipy_stats.norm.ppf(1 - alpha)
    grid = np.linspace(0.3, 1.6, 27) * predicted
    power = []
    for delta in grid:
        base = rng.uniform(size=(sims, n)) < rate
        var = rng.uniform(size=(sims, n)) < rate + delta
        d = var.astype(float) - base
        low = d.mean(axis=1) - z * d.std(axis=1, ddof=1) / math.sqrt(n)
        power.append(float(np.mean(low > 0)))
    crossing = float(np.interp(0.8, power, grid))
    assert predicted == pytest.approx(crossing, rel=0.10)


def test_bootstrap_se_of_a_mean_and_the_general_detectable_effect():
    """The general route (bootstrap SE of the baseline, paired with independent errors) agrees
    with the closed form for a rate."""
    n, rate = 400, 0.6
    correct = np.arange(n) < rate * n
    se = float(bootstrap_se(mean_stat(correct), n, samples=4000, seed=3))
    assert se == pytest.approx(math.sqrt(rate * (1 - rate) / n), rel=0.05)
    general = detectable_effect(paired_se(se), 0.025, 0.8)
    assert general == pytest.approx(rate_detectable_effect(n, rate), rel=0.06)


def test_examples_needed_and_to_settle():
    # the detectable effect shrinks as 1/sqrt(n): halving it takes four times the examples
    assert examples_needed(127, 0.10, 0.05) == 508
    assert examples_needed(127, 0.04, 0.05) == 127
    assert examples_needed(127, 0.10, 0.0) is None
    # a half-width of 0.06 around an estimate 0.03 from the margin: four times the examples
    assert examples_to_settle(100, 0.06, 0.03) == 400
    assert examples_to_settle(100, 0.06, 0.0) is None


def test_synthetic_predictions_hold_the_accuracy_and_the_balance():
    golds, preds = synthetic_predictions([20, 30, 10], 0.7)
    assert [golds.count(c) for c in range(3)] == [20, 30, 10]
    assert sum(g == p for g, p in zip(golds, preds, strict=True)) == 14 + 21 + 7


def test_mcnemar_matches_scipy_binomtest_and_statsmodels():
    from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar

    base = [True] * 30 + [False] * 12 + [True] * 40 + [False] * 18
    var = [False] * 30 + [True] * 12 + [True] * 40 + [False] * 18
    ours = mcnemar(base, var)
    ref = sm_mcnemar([[40, 30], [12, 18]], exact=False, correction=True)
    assert ours["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)
    small_base, small_var = [True] * 5 + [False] * 2, [False] * 5 + [True] * 2
    exact = scipy_stats.binomtest(2, 7, 0.5).pvalue
    assert mcnemar(small_base, small_var)["p_value"] == pytest.approx(exact, rel=1e-9)
