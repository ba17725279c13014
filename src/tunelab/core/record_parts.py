"""The typed pieces nested in records: a comparison's rows, intervals, guardrail verdicts and
flips, and a run's environment.

Each piece is a `Record` read at a place inside its record file (`where`, e.g.
`runs[1].guardrails[0]`), so a damaged piece raises the located `StudyError` naming the file,
the place and the field. The writers are `stages.compare` (`compare_evaluations`,
`_compare_run`, `compare_study`) and `core.env` (env.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tunelab.core.record_base import (
    OPT_BOOL,
    OPT_DICT,
    OPT_INT,
    OPT_LIST,
    OPT_NUM,
    OPT_STR,
    Record,
    damaged,
    mapping_of,
)

__all__ = [
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

    FIELDS: ClassVar = {
        "baseline": OPT_NUM,
        "variant": OPT_NUM,
        "delta": OPT_NUM,
        "ci_low": OPT_NUM,
        "ci_high": OPT_NUM,
    }

    baseline: float | None = None
    variant: float | None = None
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


@dataclass(frozen=True)
class Primary(Delta):
    """The primary metric's row: its delta and interval, and the test judged on them."""

    FIELDS: ClassVar = Delta.FIELDS | {
        "metric": OPT_STR,
        "min_improvement": OPT_NUM,
        "meets_min_improvement": OPT_BOOL,
        "significant": OPT_BOOL,
        "verdict": OPT_STR,
        "goal": OPT_STR,
        "level": OPT_NUM,
        "settle_n": OPT_INT,
    }

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

    FIELDS: ClassVar = {
        "rule": OPT_STR,
        "metric": OPT_STR,
        "scope": OPT_STR,
        "item": OPT_STR,
        "value": OPT_NUM,
        "baseline": OPT_NUM,
        "bound": OPT_NUM,
        "test": OPT_STR,
        "pass": (bool,),
        "note": OPT_STR,
        "verdict": OPT_STR,
        "ci_low": OPT_NUM,
        "ci_high": OPT_NUM,
        "judged_bound": OPT_NUM,
        "adjusted_level": OPT_NUM,
        "settle_n": OPT_INT,
    }
    RENAMED: ClassVar = {"pass": "passed"}

    rule: str | None = None
    metric: str | None = None
    scope: str | None = None
    item: str | None = None
    value: float | None = None
    baseline: float | None = None
    bound: float | None = None
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

    FIELDS: ClassVar = {
        "improved": OPT_LIST,
        "regressed": OPT_LIST,
        "num_improved": OPT_INT,
        "num_regressed": OPT_INT,
        "by_category": OPT_DICT,
    }

    improved: list[str] | None = None
    regressed: list[str] | None = None
    num_improved: int | None = None
    num_regressed: int | None = None
    by_category: dict[str, dict[str, int]] | None = None


@dataclass(frozen=True)
class McNemar(Record):
    """McNemar's test on the paired right/wrong outcomes: `c` examples improved, `b`
    regressed (older records name the discordant counts `improved` and `regressed`)."""

    FIELDS: ClassVar = {
        "method": OPT_STR,
        "b": OPT_INT,
        "c": OPT_INT,
        "improved": OPT_INT,
        "regressed": OPT_INT,
        "p_value": OPT_NUM,
    }

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

    FIELDS: ClassVar = {"path": (str,), "group": OPT_STR}
    RENAMED: ClassVar = {"path": "key"}

    key: str = ""
    group: str | None = None

    @property
    def old(self) -> Any:
        return self.raw.get("old")

    @property
    def new(self) -> Any:
        return self.raw.get("new")


@dataclass(frozen=True)
class ConfigDiff(Record):
    """A run's config against its parent's (or the baseline's): the changes and their flags."""

    FIELDS: ClassVar = {"against": OPT_STR, "groups": OPT_LIST, "flags": OPT_LIST, "why": OPT_STR}

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

    FIELDS: ClassVar = {
        "run_id": (str,),
        "name": OPT_STR,
        "kind": OPT_STR,
        "parent": OPT_STR,
        "status": OPT_STR,
        "reason": OPT_STR,
        "why": OPT_STR,
        "compared": OPT_BOOL,
        "not_compared_reason": OPT_STR,
        "eval_run": OPT_STR,
        "n_paired": OPT_INT,
        "notes": OPT_LIST,
        "flags": OPT_LIST,
        "guardrails_pass": OPT_BOOL,
        "guardrails_verdict": OPT_STR,
        "decision": OPT_STR,
        "decision_reasons": OPT_LIST,
    }

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

    FIELDS: ClassVar = {
        "confidence": OPT_NUM,
        "alpha": OPT_NUM,
        "multiplicity": OPT_STR,
        "goal": OPT_STR,
        "interval_method": OPT_STR,
    }

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

    FIELDS: ClassVar = {
        "run_id": (str,),
        "kind": OPT_STR,
        "eval_run": OPT_STR,
        "spec_sha256": OPT_STR,
        "n": OPT_INT,
        "metrics": OPT_DICT,
    }

    run_id: str = ""
    kind: str | None = None
    eval_run: str | None = None
    spec_sha256: str | None = None
    n: int | None = None
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class Gpu(Record):
    """One GPU an environment saw."""

    FIELDS: ClassVar = {"name": OPT_STR, "memory_bytes": OPT_INT}

    name: str | None = None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class RunEnv(Record):
    """runs/<run>/env.json: where a run computed (core.env.environment)."""

    FIELDS: ClassVar = {
        "python": OPT_STR,
        "torch": OPT_STR,
        "cuda": OPT_STR,
        "driver": OPT_STR,
        "gpus": OPT_LIST,
        "cpu": OPT_DICT,
        "packages": OPT_DICT,
        "compute_device": OPT_STR,
        "backend": OPT_STR,
        "tunelab_git": OPT_DICT,
        "os": OPT_DICT,
        "rocm": OPT_STR,
        "cudnn": (str, int, type(None)),
        "nccl": (str, int, list, type(None)),
        "attention": OPT_DICT,
        "bf16_supported": OPT_BOOL,
    }

    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    driver: str | None = None
    gpus: list[dict[str, Any]] | None = None
    cpu: dict[str, Any] | None = None
    packages: dict[str, str] | None = None
    compute_device: str | None = None
    backend: str | None = None
    tunelab_git: dict[str, Any] | None = None
    os: dict[str, Any] | None = None
    rocm: str | None = None
    cudnn: str | int | None = None
    nccl: str | int | list[int] | None = None
    attention: dict[str, bool] | None = None  # kernel -> available here
    bf16_supported: bool | None = None

    @property
    def devices(self) -> list[Gpu]:
        """The GPUs it saw ([] on a CPU)."""
        return self.parts(Gpu, "gpus")

    @property
    def logical_cores(self) -> int | None:
        return (self.cpu or {}).get("logical_cores")

    @property
    def git_commit(self) -> str | None:
        """The commit of the tunelab checkout it ran (None for an installed package)."""
        return (self.tunelab_git or {}).get("commit")

    @property
    def cpu_text(self) -> str:
        """The CPU's name and its logical cores."""
        cpu = self.cpu or {}
        return f"{cpu.get('name')} ({cpu.get('logical_cores')} cores)"

    def check_parts(self) -> None:
        _ = self.devices


@dataclass(frozen=True)
class ModelIdentity(Record):
    """A base model's identity as a record names it (lib.models.identity.model_identity)."""

    FIELDS: ClassVar = {
        "name": OPT_STR,
        "revision": OPT_STR,
        "path": OPT_STR,
        "sha256": OPT_STR,
        "architecture": OPT_STR,
        "files": OPT_DICT,
        "source": OPT_DICT,
    }
    RENAMED: ClassVar = {"path": "location"}

    name: str | None = None
    revision: str | None = None
    location: str | None = None  # the folder it was read from
    sha256: str | None = None
    architecture: str | None = None
    files: dict[str, str] | None = None  # file name -> sha256
    source: dict[str, Any] | None = None  # {hub: {repo_id, revision, commit}} | {gguf_sha256}

    @property
    def hub(self) -> dict[str, Any]:
        """The hub commit the base is pinned to ({} for a local base)."""
        return (self.source or {}).get("hub") or {}


@dataclass(frozen=True)
class CategoryMetrics(Record):
    """One category's figures in an evaluation (classification)."""

    FIELDS: ClassVar = {
        "precision": OPT_NUM,
        "recall": OPT_NUM,
        "f1": OPT_NUM,
        "support": OPT_INT,
    }

    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    support: int | None = None


@dataclass(frozen=True)
class FieldMetrics(Record):
    """One field path's figures in an evaluation (extraction): rates over its `slots`."""

    FIELDS: ClassVar = {
        "presence_rate": OPT_NUM,
        "exact_match": OPT_NUM,
        "normalized_match": OPT_NUM,
        "precision": OPT_NUM,
        "recall": OPT_NUM,
        "f1": OPT_NUM,
        "slots": OPT_INT,
        "kind": OPT_STR,
        "failures": OPT_DICT,
    }

    presence_rate: float | None = None
    exact_match: float | None = None
    normalized_match: float | None = None
    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    slots: int | None = None
    kind: str | None = None  # value | object | list: what the schema path holds
    failures: dict[str, int] | None = None  # failed slots by kind (missing, wrong_type, ...)


@dataclass(frozen=True)
class Confusion(Record):
    """A confusion matrix: rows the gold `labels`, columns the `predicted` labels (a label the
    model answered outside the list included)."""

    FIELDS: ClassVar = {"labels": (list,), "predicted": (list,), "matrix": (list,)}

    labels: list[str] | None = None
    predicted: list[str] | None = None
    matrix: list[list[int]] | None = None


@dataclass(frozen=True)
class Decoding(Record):
    """How a generative evaluation decoded: batches, steps, and answers over the budget."""

    FIELDS: ClassVar = {
        "steps": OPT_INT,
        "batches": OPT_LIST,
        "answer_steps": OPT_INT,
        "s_per_step": OPT_NUM,
        "answers_over_budget": OPT_INT,
    }

    steps: int | None = None
    batches: list[Any] | None = None
    answer_steps: int | None = None
    s_per_step: float | None = None
    answers_over_budget: int | None = None


@dataclass(frozen=True)
class CheckpointCheck(Record):
    """A checkpoint's files against the sha256 its run recorded."""

    FIELDS: ClassVar = {
        "ok": OPT_BOOL,
        "files_checked": OPT_INT,
        "changed": OPT_LIST,
        "missing": OPT_LIST,
    }

    ok: bool | None = None
    files_checked: int | None = None
    changed: list[str] | None = None
    missing: list[str] | None = None


@dataclass(frozen=True)
class Mismatch(Record):
    """One recorded prediction a fresh process did not reproduce (`recorded`, `fresh`: the
    values as written)."""

    FIELDS: ClassVar = {"id": (str, int), "field": OPT_STR}
    RENAMED: ClassVar = {"field": "what"}

    id: str | int = ""
    what: str | None = None  # the field of the prediction that differs

    @property
    def recorded(self) -> Any:
        return self.raw.get("recorded")

    @property
    def fresh(self) -> Any:
        return self.raw.get("fresh")


@dataclass(frozen=True)
class Reproduced(Record):
    """How many recorded predictions a fresh process reproduced, within `atol`."""

    FIELDS: ClassVar = {
        "matched": OPT_INT,
        "n": OPT_INT,
        "atol": OPT_NUM,
        "max_score_diff": OPT_NUM,
    }

    matched: int | None = None
    n: int | None = None
    atol: float | None = None
    max_score_diff: float | None = None

    @property
    def mismatches(self) -> list[Mismatch]:
        return self.parts(Mismatch, "mismatches")


@dataclass(frozen=True)
class EnvironmentCheck(Record):
    """This process's environment against the run's."""

    FIELDS: ClassVar = {"same": OPT_BOOL, "message": OPT_STR}

    same: bool | None = None
    message: str | None = None


@dataclass(frozen=True)
class FreshTimings(Record):
    """Seconds a fresh process took to load the checkpoint and to evaluate."""

    FIELDS: ClassVar = {"load_s": OPT_NUM, "eval_s": OPT_NUM}

    load_s: float | None = None
    eval_s: float | None = None


@dataclass(frozen=True)
class SizingRow(Record):
    """One configuration a sizing measured: its options, the predicted and measured peak
    (MiB) and step time (records before the flat figures hold them in `predicted` and
    `measured`)."""

    FIELDS: ClassVar = {
        "label": OPT_STR,
        "name": OPT_STR,
        "seq_len": OPT_INT,
        "micro_batch": OPT_INT,
        "predicted_mb": OPT_NUM,
        "measured_mb": OPT_NUM,
        "error_pct": OPT_NUM,
        "step_s": OPT_NUM,
        "status": OPT_STR,
        "reason": OPT_STR,
        "predicted": OPT_DICT,
        "measured": OPT_DICT,
    }

    label: str | None = None
    name: str | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    predicted_mb: float | None = None
    measured_mb: float | None = None
    error_pct: float | None = None
    step_s: float | None = None
    status: str | None = None
    reason: str | None = None
    predicted: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None

    @property
    def title(self) -> Any:
        """The row's label, else its name, else its options as written."""
        return self.label or self.name or self.raw.get("options")

    @property
    def predicted_peak_mb(self) -> float | None:
        return self.predicted_mb or (self.predicted or {}).get("total_mb")

    @property
    def measured_peak_mb(self) -> float | None:
        return self.measured_mb or (self.measured or {}).get("peak_mb")

    @property
    def measured_step_s(self) -> float | None:
        return self.step_s or (self.measured or {}).get("step_s")


@dataclass(frozen=True)
class AdaptationSettings(Record):
    """The `adaptation` section of a run's saved config, as the dossier names the method."""

    FIELDS: ClassVar = {"method": OPT_STR, "rank": OPT_INT, "quantization": OPT_DICT}

    method: str | None = None
    rank: int | None = None
    quantization: dict[str, Any] | None = None

    @property
    def quant_type(self) -> str:
        """QLoRA's 4-bit type (nf4 when the config names none)."""
        return (self.quantization or {}).get("quant_type", "nf4")
