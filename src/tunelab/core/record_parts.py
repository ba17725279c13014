"""The typed pieces nested in records: a comparison's rows, intervals, guardrail verdicts and
flips here; the pieces of a run's records (environment, evaluation tables, verification
checks, sizing rows, base identity, hypothesis rules) in `core/run_parts`, re-exported here.

Each piece is a `Record` read at a place inside its record file (`where`, e.g.
`runs[1].guardrails[0]`), so a damaged piece raises the located `StudyError` naming the file,
the place and the field. The comparison's writers are `stages.compare`
(`evaluations.compare_evaluations`, `stage._compare_run`, `stage.run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tunelab.core.record_base import (
    Record,
    as_written,
    damaged,
    mapping_of,
)
from tunelab.core.run_parts import (
    AdaptationSettings,
    CategoryMetrics,
    CheckpointCheck,
    Confusion,
    Decoding,
    EnvironmentCheck,
    FieldMetrics,
    FreshTimings,
    Gpu,
    GuardrailRule,
    Mismatch,
    ModelIdentity,
    Pin,
    Reproduced,
    RunEnv,
    SizingRow,
)

__all__ = [
    "GuardrailRule",
    "Pin",
    "AdaptationSettings",
    "SizingRow",
    "CheckpointCheck",
    "EnvironmentCheck",
    "FreshTimings",
    "Mismatch",
    "Reproduced",
    "CategoryMetrics",
    "Confusion",
    "Decoding",
    "FieldMetrics",
    "CompareBaseline",
    "CompareEntry",
    "ConfigChange",
    "ConfigDiff",
    "Delta",
    "Flips",
    "Gpu",
    "GuardrailVerdict",
    "LockedTests",
    "McNemar",
    "ModelIdentity",
    "Primary",
    "RunEnv",
]


@dataclass(frozen=True)
class Delta(Record):
    """One metric of a variant against the baseline, with its paired interval (None: none)."""

    baseline: float | None = None
    variant: float | None = None
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


@dataclass(frozen=True)
class Primary(Delta):
    """The primary metric's row: its delta and interval, and the test judged on them."""

    metric: str | None = None
    min_improvement: float | None = None
    meets_min_improvement: bool | None = None
    significant: bool | None = None
    verdict: str | None = None  # better | not better | inconclusive (or an equivalence verdict)
    goal: str | None = None
    level: float | None = None
    settle_n: int | None = None  # the split size that would likely settle an inconclusive test


@dataclass(frozen=True)
class GuardrailVerdict(Record):
    """One guardrail rule judged on one item (a category, a field, or overall)."""

    RENAMED: ClassVar = {"pass": "passed"}

    rule: str | None = None
    metric: str | None = None
    scope: str | None = None
    item: str | None = None
    op: str | None = None
    value: float | None = None
    baseline: float | None = None
    bound: float | None = None
    margin: float | None = None  # the rule's value: the bound, or its distance from the baseline
    relative_to: str | None = None  # "baseline", or None for an absolute bound
    test: str | None = None  # point | interval
    passed: bool = False
    note: str | None = None
    verdict: str | None = None  # pass | fail | inconclusive
    ci_low: float | None = None
    ci_high: float | None = None
    judged_bound: float | None = None
    adjusted_level: float | None = None
    settle_n: int | None = None

    @property
    def outcome(self) -> str:
        """pass | fail | inconclusive: the verdict, or the point pass of an older record."""
        return self.verdict or ("pass" if self.passed else "fail")


@dataclass(frozen=True)
class Flips(Record):
    """The examples that changed between baseline and variant (ids), and how many."""

    improved: list[str] | None = None
    regressed: list[str] | None = None
    num_improved: int | None = None
    num_regressed: int | None = None
    by_category: dict[str, dict[str, int]] | None = None


@dataclass(frozen=True)
class McNemar(Record):
    """McNemar's test on the paired right/wrong outcomes: `c` examples improved, `b`
    regressed (older records name the discordant counts `improved` and `regressed`)."""

    method: str | None = None
    b: int | None = None
    c: int | None = None
    improved: int | None = None
    regressed: int | None = None
    p_value: float | None = None


@dataclass(frozen=True)
class ConfigChange(Record):
    """One field a run changes against its parent: `key` its dotted path in the config (`path`
    in the record), `old` and `new` the values as written."""

    RENAMED: ClassVar = {"path": "key"}

    key: str = ""
    group: str | None = None

    old = as_written("old")
    new = as_written("new")


@dataclass(frozen=True)
class ConfigDiff(Record):
    """A run's config against its parent's (or the baseline's): the changes and their flags."""

    against: str | None = None
    groups: list[str] | None = None
    flags: list[str] | None = None
    why: str | None = None

    @property
    def changes(self) -> list[ConfigChange]:
        return self.parts(ConfigChange, "changes")


@dataclass(frozen=True)
class CompareEntry(Record):
    """One row of a comparison: a run against the baseline, or why it is not compared."""

    run_id: str = ""
    name: str | None = None
    kind: str | None = None
    parent: str | None = None
    status: str | None = None
    reason: str | None = None
    why: str | None = None
    compared: bool | None = None
    not_compared_reason: str | None = None
    eval_run: str | None = None
    n_paired: int | None = None
    notes: list[str] | None = None
    flags: list[str] | None = None
    guardrails_pass: bool | None = None
    guardrails_verdict: str | None = None  # pass | fail | inconclusive
    decision: str | None = None  # adopt | reject | inconclusive (None: a record before them)
    decision_reasons: list[str] | None = None

    @property
    def label(self) -> str:
        """The run's name, else its id."""
        return self.name or self.run_id

    def check_parts(self) -> None:
        _ = self.primary, self.metrics, self.per_category, self.per_field
        _ = self.guardrails, self.flips, self.mcnemar
        if (diff := self.config_diff) is not None:
            _ = diff.changes

    @property
    def primary(self) -> Primary:
        return self.part(Primary, "primary") or Primary(self.path, {}, where=self._at("primary"))

    @property
    def metrics(self) -> dict[str, Delta]:
        return self.parts_by_key(Delta, "metrics")

    @property
    def per_category(self) -> dict[str, dict[str, Delta]]:
        return self._table("per_category")

    @property
    def per_field(self) -> dict[str, dict[str, Delta]]:
        return self._table("per_field")

    @property
    def guardrails(self) -> list[GuardrailVerdict]:
        return self.parts(GuardrailVerdict, "guardrails")

    @property
    def mcnemar(self) -> McNemar | None:
        return self.part(McNemar, "mcnemar")

    @property
    def config_diff(self) -> ConfigDiff | None:
        return self.part(ConfigDiff, "config_diff")

    @property
    def flips(self) -> Flips:
        return self.part(Flips, "flips") or Flips(self.path, {}, where=self._at("flips"))

    @property
    def guardrails_outcome(self) -> str:
        """pass | fail | inconclusive: the recorded verdict, or the point pass of an older
        record."""
        return self.guardrails_verdict or ("pass" if self.guardrails_pass else "fail")

    def _table(self, name: str) -> dict[str, dict[str, Delta]]:
        """{item: {metric: Delta}} of a per-category or per-field table."""
        table = self.raw.get(name)
        at = self._at(name)
        if table is not None and not isinstance(table, dict):
            raise damaged(self.path, f"{at}: {table!r}, not an object")
        return {
            item: mapping_of(Delta, self.path, row, f"{at}.{item}")
            for item, row in (table or {}).items()
        }


@dataclass(frozen=True)
class LockedTests(Record):
    """The tests a comparison applied (stages.compare.verdicts.DecisionTests): a record made
    before them reads as the defaults: 95 % intervals, Holm, superiority."""

    confidence: float | None = None
    alpha: float | None = None
    multiplicity: str | None = None
    goal: str | None = None
    interval_method: str | None = None

    @property
    def level(self) -> float:
        """The two-sided confidence (0.95 when the record names none)."""
        return 0.95 if self.confidence is None else self.confidence

    @property
    def one_sided(self) -> float:
        """The level of each one-sided test (0.025 when the record names none)."""
        return 0.025 if self.alpha is None else self.alpha


@dataclass(frozen=True)
class CompareBaseline(Record):
    """The baseline a comparison sets every run against."""

    run_id: str = ""
    kind: str | None = None
    eval_run: str | None = None
    spec_sha256: str | None = None
    n: int | None = None
    metrics: dict[str, float] | None = None
