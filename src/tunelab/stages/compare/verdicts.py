"""One decision, three outcomes: the primary metric's test, and adopt / reject / inconclusive.

Pure: the locked hypothesis, bootstrap draws and guardrail verdicts in, verdicts out.

- superiority (the default goal): the variant is better when the lower bound of the delta's
  interval is above 0 and the delta reaches `min_improvement`; not better when the upper bound
  is below `min_improvement` (the improvement that counts is ruled out); else inconclusive.
- equivalence (`goal: equivalence`): two one-sided tests (TOST) of |delta| < margin, read on
  the same interval: equivalent when it lies inside +-margin, not equivalent when it lies
  beyond one side, else inconclusive.
- the run: adopt when the primary test succeeds and every guardrail passes; reject when the
  primary test fails or any guardrail fails; inconclusive otherwise, with what would settle it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tunelab.core.config_sections import HypothesisConfig
from tunelab.core.config_training import EvaluationConfig
from tunelab.core.record_parts import GuardrailVerdict, Primary
from tunelab.core.run_parts import GuardrailRule as LockedRule
from tunelab.core.run_parts import LockedSpec
from tunelab.lib.statistics import Estimate, Stat, examples_to_settle, tost_p_value, tost_verdict

# rates of examples: an absolute bound on one of them is judged on its Wilson interval
RATE_METRICS = frozenset(
    {
        "accuracy",
        "json_valid_rate",
        "schema_valid_rate",
        "format_valid_rate",
        "exact_match",
        "all_fields_match_rate",
    }
)
_TABLE = {"every_category": ("per_category.", "category_"), "every_field": ("per_field.", "field_")}


def _default(model: Any, name: str) -> Any:
    return model.model_fields[name].default


@dataclass(frozen=True)
class DecisionTests:
    """The tests a locked hypothesis names (a record locked before these settings existed
    reads with the documented defaults)."""

    confidence: float = _default(EvaluationConfig, "confidence")
    interval_method: str = _default(EvaluationConfig, "interval_method")
    multiplicity: str = _default(EvaluationConfig, "multiplicity")
    goal: str = _default(HypothesisConfig, "goal")
    equivalence_margin: float | None = None

    @property
    def alpha(self) -> float:
        """The level of each one-sided test."""
        return (1 - self.confidence) / 2

    @classmethod
    def from_locked(cls, content: LockedSpec | Mapping[str, Any]) -> DecisionTests:
        """The tests of a locked hypothesis's content (as written, or typed)."""
        if not isinstance(content, LockedSpec):
            content = LockedSpec.of("the locked hypothesis", content, "content")
        ev, claim = content.tests, content.claim
        base = cls()
        return cls(
            confidence=float(base.confidence if ev.confidence is None else ev.confidence),
            interval_method=ev.interval_method or base.interval_method,
            multiplicity=ev.multiplicity or base.multiplicity,
            goal=claim.goal or base.goal,
            equivalence_margin=claim.equivalence_margin,
        )

    def as_record(self) -> dict[str, Any]:
        return asdict(self) | {"alpha": self.alpha}


def stat_key(metric: str, scope: str) -> str:
    """The bootstrap statistic a guardrail metric is resampled as."""
    if scope == "overall":
        return metric
    table, prefix = _TABLE[scope]
    return table + metric.removeprefix(prefix)


def value_pairs(
    guardrails: Sequence[Any], pairs: Mapping[str, tuple[Stat, Stat]]
) -> dict[str, tuple[Stat, Stat]]:
    """The run's own statistics an absolute interval rule is judged on, as "value.<key>"
    pairs against 0 (their paired "delta" is the run's value)."""
    out = {}
    for i, raw in enumerate(guardrails):
        written = raw if isinstance(raw, Mapping) else raw.model_dump()
        rule = LockedRule.of("the locked guardrails", written, f"guardrails[{i}]")
        if rule.relative_to or (rule.test or "interval") != "interval":
            continue
        key = stat_key(str(rule.metric), rule.scope or "overall")
        if key in pairs:
            run = pairs[key][1]
            out[f"value.{key}"] = (lambda w, s=run: np.zeros_like(s(w)), run)
    return out


def estimates(
    point: Mapping[str, tuple[np.ndarray, np.ndarray]],
    draws: Mapping[str, np.ndarray | None],
    *,
    labels: Sequence[str],
    paths: Sequence[str],
    n: int,
    tests: DecisionTests,
):
    """The `EstimateOf` guardrail judging asks: the delta (relative rules) or the run's value
    (absolute rules) of a metric on an item, from the bootstrap draws; an overall rate under
    an absolute bound from its Wilson interval when `interval_method` is wilson."""

    def estimate_of(metric: str, scope: str, item: Any, relative: bool) -> Estimate | None:
        key = stat_key(metric, scope)
        items = {"every_category": labels, "every_field": paths}.get(scope)
        col = None if items is None else (list(items).index(item) if item in items else -1)
        if not relative:
            if scope == "overall" and tests.interval_method == "wilson" and metric in point:
                if metric in RATE_METRICS:
                    value = float(point[metric][1])
                    return Estimate(point=value, successes=value * n, trials=n)
            key = f"value.{key}"
        d = draws.get(key)
        if d is None or col == -1:
            return None
        base, run = point[key]
        delta = np.asarray(run - base, dtype=np.float64)
        if col is not None:
            return Estimate(point=float(delta[col]), draws=d[:, col])
        return Estimate(point=float(delta), draws=d)

    return estimate_of


def primary_verdict(
    primary: Mapping[str, Any],
    est: Estimate | None,
    tests: DecisionTests,
    min_improvement: float,
    n: int,
) -> dict[str, Any]:
    """The primary metric's test: {goal, verdict, level, settle_n, tost_p_value}."""
    out: dict[str, Any] = {"goal": tests.goal, "level": tests.alpha, "settle_n": None}
    if est is None:
        return out | {"verdict": "inconclusive", "note": "the primary metric has no interval"}
    low, high = est.lower(tests.alpha), est.upper(tests.alpha)
    half = (high - low) / 2
    if tests.goal == "equivalence":
        margin = float(tests.equivalence_margin or 0.0)
        verdict, _, _ = tost_verdict(est, margin, tests.alpha)
        distance = abs(margin - abs(est.point))
        out |= {"equivalence_margin": margin, "tost_p_value": tost_p_value(est, margin)}
    else:
        if low > 0 and est.point >= min_improvement:
            verdict = "better"
        elif high < min_improvement:
            verdict = "not better"
        else:
            verdict = "inconclusive"
        # toward the nearer conclusion: the bound clearing 0, or the improvement ruled out
        distance = est.point if est.point >= min_improvement else min_improvement - est.point
    if verdict == "inconclusive":
        out["settle_n"] = examples_to_settle(n, half, distance)
    return out | {"verdict": verdict}


def run_decision(
    primary: Primary, guardrails: Sequence[GuardrailVerdict], guardrails_verdict: str
) -> tuple[str, list[str]]:
    """adopt | reject | inconclusive, and the reasons (each with the bound behind it)."""
    verdict = primary.verdict
    metric = primary.metric
    reasons = []
    if verdict in ("not better", "not equivalent"):
        reasons.append(f"{metric}: {verdict} ({_bounds(primary)})")
    failed = [g for g in guardrails if g.verdict == "fail"]
    for g in failed[:3]:
        reasons.append(f"guardrail fails: {_guard_text(g)}")
    if reasons:
        return "reject", reasons + _more(len(failed) - 3)
    open_items = [g for g in guardrails if g.verdict == "inconclusive"]
    if verdict == "inconclusive":
        reasons.append(f"{metric}: inconclusive ({_bounds(primary)})")
    for g in open_items[:3]:
        reasons.append(f"guardrail inconclusive: {_guard_text(g)}")
    if reasons:
        return "inconclusive", reasons + _more(len(open_items) - 3)
    return "adopt", [f"{metric}: {verdict} ({_bounds(primary)}); every guardrail passes"]


def _more(count: int) -> list[str]:
    return [f"and {count} more"] if count > 0 else []


def _bounds(p: Primary) -> str:
    low, high = p.ci_low, p.ci_high
    if low is None or high is None:
        return "no interval"
    delta = p.delta or 0.0
    return f"delta {delta:+.4f}, interval [{low:+.4f}, {high:+.4f}]"


def _guard_text(g: GuardrailVerdict) -> str:
    item = f" on {g.item}" if g.item is not None else ""
    bound = g.judged_bound
    judged = "" if bound is None else f", bound {bound:+.4f} vs margin {g.margin:+g}"
    return f"{g.rule}{item}{judged}"
