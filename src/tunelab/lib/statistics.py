"""The statistics a decision rests on: arrays in, numbers out (no disk, no model).

Paired bootstrap: the same resampled example multiset is applied to the baseline and the
variant, so the interval is for the difference on the same examples. A resample is drawn as
multinomial counts `W [samples, n]`; every metric is written as a function of those counts
(means, ratios of sums, F1 from weighted confusion counts), so all metrics share one draw.

Conventions: `confidence` is two-sided (0.95); each one-sided test runs at
`alpha = (1 - confidence) / 2`, so a one-sided test passes exactly when the matching bound of the
two-sided interval clears its margin. Normal quantiles come from the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

Stat = Callable[[np.ndarray], np.ndarray]  # counts [B, n] -> values [B] or [B, k]
_NORMAL = NormalDist()

# ---------------------------------------------------------------- statistics of resample counts


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float64), where=b != 0)


def mean_stat(x: Sequence[float] | np.ndarray) -> Stat:
    """The weighted mean of a per-example value ([n] -> [B]; [n, k] -> [B, k])."""
    arr = np.asarray(x, dtype=np.float64)
    return lambda w: (w @ arr) / w.sum(axis=1, keepdims=arr.ndim > 1)


def ratio_stat(num: Sequence[float] | np.ndarray, den: Sequence[float] | np.ndarray) -> Stat:
    """sum(w * num) / sum(w * den): micro averages such as field micro-F1 (2 tp / (pred + gold))."""
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    return lambda w: _safe_div(w @ a, w @ b)


def zero_stat(w: np.ndarray) -> np.ndarray:
    """0 for every resample: paired with a statistic, its "delta" is the statistic itself."""
    return np.zeros(w.shape[0])


def f1_stats(
    golds: Sequence[str], preds: Sequence[str | None], labels: Sequence[str]
) -> dict[str, Stat]:
    """Per-category precision, recall and F1 [B, C], macro F1 and weighted F1 [B] from weighted
    confusion counts, with the definitions of `metrics.classification_metrics`."""
    index = {label: i for i, label in enumerate(labels)}
    gold = np.zeros((len(golds), len(labels)))
    pred = np.zeros((len(golds), len(labels)))
    for row, (g, p) in enumerate(zip(golds, preds, strict=True)):
        gold[row, index[g]] = 1.0
        if p in index:
            pred[row, index[p]] = 1.0
    hit = gold * pred

    def precision(w: np.ndarray) -> np.ndarray:
        return _safe_div(w @ hit, w @ pred)

    def recall(w: np.ndarray) -> np.ndarray:
        return _safe_div(w @ hit, w @ gold)

    def per_category(w: np.ndarray) -> np.ndarray:
        p, r = precision(w), recall(w)
        return _safe_div(2 * p * r, p + r)

    def weighted(w: np.ndarray) -> np.ndarray:
        support = w @ gold
        return _safe_div((per_category(w) * support).sum(axis=1), support.sum(axis=1))

    return {
        "per_category_precision": precision,
        "per_category_recall": recall,
        "per_category_f1": per_category,
        "macro_f1": lambda w: per_category(w).mean(axis=1),
        "weighted_f1": weighted,
    }


# ---------------------------------------------------------------- paired bootstrap


def resample_counts(n: int, samples: int, seed: int, chunk: int = 250):
    """Multinomial resample counts in chunks of [<= chunk, n] (one generator, same seed, same
    draws)."""
    rng = np.random.default_rng(seed)
    probs = np.full(n, 1.0 / n)
    done = 0
    while done < samples and n > 0:
        size = min(chunk, samples - done)
        yield rng.multinomial(n, probs, size=size).astype(np.float64)  # [size, n]
        done += size


def paired_draws(
    stats: Mapping[str, tuple[Stat, Stat]], n: int, *, samples: int = 1000, seed: int = 0
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray | None]]:
    """The point values (baseline, variant) and the bootstrap draws of `variant - baseline`
    ([samples] or [samples, k]; None when there is no example) of each named pair."""
    ones = np.ones((1, n))
    point = {k: (a(ones)[0], b(ones)[0]) for k, (a, b) in stats.items()}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in stats}
    for w in resample_counts(n, samples, seed):
        for k, (a, b) in stats.items():
            parts[k].append(b(w) - a(w))
    draws = {k: (np.concatenate(v, axis=0) if v else None) for k, v in parts.items()}
    return point, draws


def summarize_draws(
    point: Mapping[str, tuple[np.ndarray, np.ndarray]],
    draws: Mapping[str, np.ndarray | None],
    confidence: float = 0.95,
) -> dict[str, dict[str, Any]]:
    """name -> {"baseline", "variant", "delta", "ci_low", "ci_high"}: percentile intervals of
    the delta (floats, or lists for vector statistics such as per-category F1)."""
    tail = (1.0 - confidence) / 2 * 100
    out = {}
    for k, (base, var) in point.items():
        d = draws.get(k)
        if d is not None:
            low, high = np.percentile(d, [tail, 100 - tail], axis=0)
        else:
            low = high = var - base
        out[k] = {
            "baseline": _plain(base),
            "variant": _plain(var),
            "delta": _plain(var - base),
            "ci_low": _plain(low),
            "ci_high": _plain(high),
        }
    return out


def paired_bootstrap(
    stats: Mapping[str, tuple[Stat, Stat]],
    n: int,
    *,
    samples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, dict[str, Any]]:
    """Percentile intervals of `variant - baseline` for each named pair of statistics.

    Args:
        stats: name -> (baseline statistic, variant statistic), both over the same n examples
            in the same order.
        n: number of paired examples.
        samples: bootstrap resamples; seed: the generator seed (same seed, same intervals).
    Returns:
        see `summarize_draws`.
    """
    point, draws = paired_draws(stats, n, samples=samples, seed=seed)
    return summarize_draws(point, draws, confidence)


def _plain(x: Any) -> Any:
    arr = np.asarray(x, dtype=np.float64)
    return float(arr) if arr.ndim == 0 else [float(v) for v in arr]


def bootstrap_se(stat: Stat, n: int, *, samples: int = 1000, seed: int = 0) -> np.ndarray:
    """The bootstrap standard error of a statistic of n examples ([] or [k])."""
    values = [stat(w) for w in resample_counts(n, samples, seed)]
    if not values:
        return np.asarray(0.0)
    return np.concatenate(values, axis=0).std(axis=0, ddof=1)


# ---------------------------------------------------------------- tests on paired correctness


def mcnemar(baseline_correct: Sequence[bool], variant_correct: Sequence[bool]) -> dict[str, Any]:
    """McNemar's test on paired correctness.

    b = baseline right and variant wrong, c = baseline wrong and variant right. With fewer than
    25 discordant pairs the two-sided exact binomial test is used, else the chi-square statistic
    with continuity correction (1 degree of freedom).
    """
    b = sum(1 for x, y in zip(baseline_correct, variant_correct, strict=True) if x and not y)
    c = sum(1 for x, y in zip(baseline_correct, variant_correct, strict=True) if y and not x)
    m = b + c
    if m == 0:
        return {"b": 0, "c": 0, "method": "exact", "statistic": None, "p_value": 1.0}
    if m < 25:
        tail = sum(math.comb(m, k) for k in range(min(b, c) + 1)) / 2**m
        return {"b": b, "c": c, "method": "exact", "statistic": None, "p_value": min(1.0, 2 * tail)}
    chi2 = (abs(b - c) - 1) ** 2 / m
    return {
        "b": b,
        "c": c,
        "method": "chi2_continuity",
        "statistic": chi2,
        "p_value": math.erfc(math.sqrt(chi2 / 2)),
    }


# ---------------------------------------------------------------- intervals and bounds


def z_of(probability: float) -> float:
    """The standard normal quantile."""
    return _NORMAL.inv_cdf(probability)


def wilson_interval(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (two-sided at `confidence`)."""
    if n <= 0:
        return 0.0, 1.0
    z = z_of(1 - (1 - confidence) / 2)
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


@dataclass(frozen=True)
class Estimate:
    """A statistic's sampling distribution, enough for a one-sided bound at any level and the
    p-value of a margin: bootstrap `draws` [B], or a proportion `successes` of `trials` (Wilson
    bounds, score-test p-values)."""

    point: float
    draws: np.ndarray | None = None
    successes: float | None = None
    trials: float | None = None

    def lower(self, alpha: float) -> float:
        """The lower bound at one-sided level alpha."""
        if self.draws is not None:
            return float(np.percentile(self.draws, 100 * alpha))
        if self.trials:
            return wilson_interval(self.successes or 0.0, self.trials, 1 - 2 * alpha)[0]
        return self.point

    def upper(self, alpha: float) -> float:
        """The upper bound at one-sided level alpha."""
        if self.draws is not None:
            return float(np.percentile(self.draws, 100 * (1 - alpha)))
        if self.trials:
            return wilson_interval(self.successes or 0.0, self.trials, 1 - 2 * alpha)[1]
        return self.point

    def p_below(self, margin: float) -> float:
        """The one-sided p-value of "the statistic is at least `margin`" (small when the
        estimate lies well below it)."""
        if self.draws is not None:
            return float(np.mean(self.draws >= margin))
        if self.trials and 0 < margin < 1:
            se = math.sqrt(margin * (1 - margin) / self.trials)
            return _NORMAL.cdf((self.point - margin) / se)
        return 1.0 if self.point >= margin else 0.0

    def p_above(self, margin: float) -> float:
        """The one-sided p-value of "the statistic is at most `margin`"."""
        if self.draws is not None:
            return float(np.mean(self.draws <= margin))
        if self.trials and 0 < margin < 1:
            se = math.sqrt(margin * (1 - margin) / self.trials)
            return 1 - _NORMAL.cdf((self.point - margin) / se)
        return 1.0 if self.point <= margin else 0.0


# ---------------------------------------------------------------- many tests at once


def step_down(
    p_values: Sequence[float], alpha: float, rejects: Callable[[int, float], bool], method: str
) -> list[tuple[bool, float]]:
    """Family-wise error control: (rejected, level) per hypothesis, in input order.

    `method`: "holm" (step-down, the i-th smallest p-value tested at alpha / (k - i)),
    "bonferroni" (every one at alpha / k), "none" (every one at alpha). `rejects(i, level)`
    says whether hypothesis i is rejected at that level (a bound beyond its margin, or its
    p-value at most the level); Holm stops at the first hypothesis not rejected, and the rest
    keep the level it stopped at.
    """
    k = len(p_values)
    if method == "none" or method == "bonferroni":
        level = alpha if method == "none" else alpha / max(k, 1)
        return [(rejects(i, level), level) for i in range(k)]
    if method != "holm":
        raise ValueError(f"unknown multiplicity method {method!r}")
    out: list[tuple[bool, float]] = [(False, alpha)] * k
    stopped_at: float | None = None
    for rank, i in enumerate(sorted(range(k), key=lambda j: p_values[j])):
        level = stopped_at if stopped_at is not None else alpha / (k - rank)
        hit = stopped_at is None and rejects(i, level)
        if not hit and stopped_at is None:
            stopped_at = level
        out[i] = (hit, level)
    return out


def holm(p_values: Sequence[float], alpha: float = 0.05) -> tuple[list[bool], list[float]]:
    """Holm's step-down procedure: (rejected, adjusted p-values), in input order."""
    k = len(p_values)
    order = sorted(range(k), key=lambda j: p_values[j])
    adjusted = [0.0] * k
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (k - rank) * p_values[i]))
        adjusted[i] = running
    rejected = [r for r, _ in step_down(p_values, alpha, lambda i, a: p_values[i] <= a, "holm")]
    return rejected, adjusted


# ---------------------------------------------------------------- equivalence (TOST)


def tost_p_value(estimate: Estimate, margin: float) -> float:
    """Two one-sided tests of |delta| < margin: the larger of the p-values of "delta <= -margin"
    and "delta >= margin" (equivalence at level alpha when it is at most alpha)."""
    return max(estimate.p_above(-margin), estimate.p_below(margin))


def tost_verdict(estimate: Estimate, margin: float, alpha: float) -> tuple[str, float, float]:
    """("equivalent" | "not equivalent" | "inconclusive", lower, upper): equivalent when the
    bounds at one-sided level alpha both lie within (-margin, +margin), not equivalent when
    they both lie beyond one side of it."""
    low, high = estimate.lower(alpha), estimate.upper(alpha)
    if -margin < low and high < margin:
        return "equivalent", low, high
    if low >= margin or high <= -margin:
        return "not equivalent", low, high
    return "inconclusive", low, high


# ---------------------------------------------------------------- power


def detectable_effect(se_delta: float, alpha: float = 0.025, power: float = 0.8) -> float:
    """The smallest true delta a one-sided test at level alpha finds with the given power, for
    a delta estimated with standard error `se_delta` (normal approximation)."""
    return (z_of(1 - alpha) + z_of(power)) * float(se_delta)


def paired_se(se_metric: float) -> float:
    """The standard error of a delta between two evaluations of the same examples whose errors
    are independent, each with standard error `se_metric`. Variants that err on the same
    examples as the baseline have a smaller one: this is the cautious figure."""
    return math.sqrt(2.0) * float(se_metric)


def rate_detectable_effect(n: int, rate: float, alpha: float = 0.025, power: float = 0.8) -> float:
    """The detectable rise of a rate (accuracy, validity) from `rate` on n paired examples,
    errors independent: solves delta = (z_a + z_b) sd(delta) / sqrt(n) with the variance of a
    paired difference at the variant's rate `rate + delta`."""
    if n <= 0:
        return math.inf
    z = z_of(1 - alpha) + z_of(power)
    delta = z * math.sqrt(2 * rate * (1 - rate) / n)
    for _ in range(50):
        v = min(1.0, rate + delta)
        var = v * (1 - rate) + rate * (1 - v) - delta * delta
        delta = z * math.sqrt(max(var, 0.0) / n)
    return delta


def examples_needed(n: int, effect_now: float, effect_wanted: float) -> int | None:
    """The split size at which the detectable effect (which shrinks as 1 / sqrt(n)) falls to
    `effect_wanted`; None when no split size gets there (a wanted effect of 0 or less)."""
    if effect_wanted <= 0 or not math.isfinite(effect_now):
        return None
    return max(n, math.ceil(n * (effect_now / effect_wanted) ** 2))


def examples_to_settle(n: int, half_width: float, distance: float) -> int | None:
    """The split size at which an interval of this half-width (shrinking as 1 / sqrt(n)) would
    likely exclude a margin `distance` away from the estimate; None when the estimate sits on
    the margin."""
    if distance <= 0 or half_width <= 0:
        return None
    return max(n + 1, math.ceil(n * (half_width / distance) ** 2))


def synthetic_predictions(counts: Sequence[int], accuracy: float) -> tuple[list[int], list[int]]:
    """A stand-in for baseline predictions before any exist: `counts[c]` examples of class c,
    round(accuracy * count) of each predicted right and the rest spread over the other classes
    in turn. Returns (golds, predictions) as class indices."""
    golds: list[int] = []
    preds: list[int] = []
    k = len(counts)
    for c, count in enumerate(counts):
        right = round(accuracy * count)
        for j in range(count):
            golds.append(c)
            preds.append(c if j < right or k == 1 else (c + 1 + j % (k - 1)) % k)
    return golds, preds
