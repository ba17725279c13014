"""The study config's sections for the question and the data: `Section` (the strict base every
section shares), the hypothesis and its guardrails, the task, and the data source, fields,
cleaning, splits and duplicates. `tunelab.core.config.StudyConfig` gathers them.

- `CLASSIFYING_KINDS`: the kinds scored as classification; test `cfg.task.kind` against it, not
  against "classification". `data.fields.image` and `task.scoring` are absent from the dump when
  unset.
- `regex_problem(text)`, `json_schema_problem(schema)`: what is wrong with a user's pattern or
  schema, or None.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

# a hub repo id: "org/name" (or a bare legacy "name"), as huggingface_hub accepts it
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")

TaskKind = Literal["classification", "format", "extraction", "image_classification"]
# kinds scored as classification (a label per example, per-category metrics)
CLASSIFYING_KINDS = ("classification", "image_classification")


def without_unset(model: BaseModel, handler: Any, field: str) -> dict[str, Any]:
    """The model serialized without `field` when it is None."""
    out = handler(model)
    if getattr(model, field) is None:
        out.pop(field, None)
    return out


def without_defaults(model: BaseModel, handler: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """The model serialized without those of `fields` that hold their default, so that records
    locked before a field existed keep their sha256 (and read back with the default)."""
    out = handler(model)
    for name in fields:
        if getattr(model, name) == type(model).model_fields[name].default:
            out.pop(name, None)
    return out


class Section(BaseModel):
    # strict: "8" is not an int and "true" not a bool; a number written as text is an error;
    # NaN and infinity are no setting's value (an infinite lr or a NaN guardrail never errs)
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False
    )


# ---------------------------------------------------------------- hypothesis and guardrails


class HypothesisConfig(Section):
    behaviour: str = Field(description="The behaviour to improve, in one sentence.")
    rationale: str = Field(description="Why the change should improve it.")
    expected_effect: str = Field(description="Expected effect size, e.g. 'macro_f1 +0.05'.")
    primary_metric: str = Field(
        description="Metric the decision rests on, e.g. macro_f1, accuracy, json_valid_rate, field_micro_f1."
    )
    min_improvement: float = Field(
        0.0, description="Smallest improvement of primary_metric over the baseline that counts."
    )
    goal: Literal["superiority", "equivalence"] = Field(
        "superiority",
        description="superiority: the variant must beat the baseline; equivalence: it must be "
        "no worse and no better than the baseline within +-equivalence_margin (TOST).",
    )
    equivalence_margin: float | None = Field(
        None,
        gt=0,
        description="goal equivalence: the largest |delta| of primary_metric that "
        "still counts as equivalent.",
    )

    @model_serializer(mode="wrap")
    def _drop_default_goal(self, handler: Any) -> dict[str, Any]:
        return without_defaults(self, handler, ("goal", "equivalence_margin"))

    @model_validator(mode="after")
    def _check_goal(self) -> HypothesisConfig:
        if (self.goal == "equivalence") != (self.equivalence_margin is not None):
            raise ValueError(
                "hypothesis.goal equivalence and hypothesis.equivalence_margin go together: "
                "set both (e.g. goal: equivalence, equivalence_margin: 0.01) or neither"
            )
        return self


class GuardrailRule(Section):
    """`metric` `op` bound, checked per item of `scope`.

    The bound is `value` when `relative_to` is absent, else the baseline's metric plus `value`
    (e.g. value -0.02 relative_to baseline: 'per-category F1 >= baseline - 0.02').
    """

    metric: str = Field(
        description="f1, precision, recall, accuracy, json_valid_rate, field_presence_rate, ..."
    )
    scope: Literal["overall", "every_category", "every_field"] = "overall"
    op: Literal[">=", "<=", ">", "<"] = ">="
    value: float = 0.0
    relative_to: Literal["baseline"] | None = None
    test: Literal["interval", "point"] = Field(
        "interval",
        description="interval: judged on the bound of the paired interval (pass, fail or "
        "inconclusive); point: on the point estimate alone (pass or fail by the luck of the "
        "draw, no error rate controlled).",
    )

    @model_serializer(mode="wrap")
    def _drop_default_test(self, handler: Any) -> dict[str, Any]:
        return without_defaults(self, handler, ("test",))

    def describe(self) -> str:
        bound = f"baseline {self.value:+g}" if self.relative_to else f"{self.value:g}"
        where = {"overall": "", "every_category": "per-category ", "every_field": "per-field "}[
            self.scope
        ]
        point = " (point estimate)" if self.test == "point" else ""
        return f"{where}{self.metric} {self.op} {bound}{point}"


# ---------------------------------------------------------------- task


class ScoringConfig(Section):
    """How an extraction answer is scored beyond the schema's own rules."""

    ordered: list[str] = Field(
        [], description="List paths whose order matters (e.g. steps); others are multisets."
    )
    tolerance: dict[str, float] = Field(
        {}, description="Absolute tolerance per number path, e.g. {'quantities[].value': 0.01}."
    )


def regex_problem(regex: str) -> str | None:
    """Why `regex` cannot serve as task.regex (None when it can): it must compile, and match
    something besides the empty answer (an empty answer always fails)."""
    try:
        re.compile(regex)
    except re.error as exc:
        return (
            f"not a valid regular expression: {exc} "
            "(Python `re` syntax; in YAML, single quotes keep backslashes as written)"
        )
    if not regex.strip():
        return "empty: it matches only an empty answer, which is never valid"
    return None


def json_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a valid JSON Schema for its draft (`$schema`, else the latest)."""
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        at = f" at {where}" if where else ""
        return f"not a valid JSON Schema{at}: {exc.message} (see https://json-schema.org)"
    return None


class TaskConfig(Section):
    kind: TaskKind = "classification"
    labels: list[str] | None = Field(None, description="Label set; read from the data when absent.")
    instruction: str = Field(
        "", description="Instruction put before the input in causal-LM prompts."
    )
    json_schema: dict[str, Any] | None = Field(
        None, description="JSON Schema the answer must satisfy (format and extraction tasks)."
    )
    regex: str | None = Field(
        None, description="Regular expression the whole answer must match (format)."
    )
    scoring: ScoringConfig | None = Field(
        None, description="Extraction scoring options: ordered lists, numeric tolerances."
    )

    @field_validator("regex")
    @classmethod
    def _check_regex(cls, regex: str | None) -> str | None:
        problem = regex_problem(regex) if regex is not None else None
        if problem:
            raise ValueError(problem)
        return regex

    @field_validator("json_schema")
    @classmethod
    def _check_json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = json_schema_problem(schema) if schema is not None else None
        if problem:
            raise ValueError(problem)
        return schema

    @model_serializer(mode="wrap")
    def _drop_unset_scoring(self, handler: Any) -> dict[str, Any]:
        # absent when unset, so the locked evaluation specs of existing studies keep their sha256
        return without_unset(self, handler, "scoring")

    @model_validator(mode="after")
    def _check_kind(self) -> TaskConfig:
        if self.kind == "format" and (self.json_schema is None) == (self.regex is None):
            raise ValueError("a format task needs exactly one of task.json_schema or task.regex")
        if self.kind == "extraction":
            if not self.json_schema or not self.json_schema.get("required"):
                raise ValueError(
                    "an extraction task needs task.json_schema with a non-empty 'required' list"
                )
        if self.scoring is not None and self.kind != "extraction":
            raise ValueError("task.scoring applies to extraction tasks only")
        return self


# ---------------------------------------------------------------- data


class SourceConfig(Section):
    format: Literal["jsonl", "csv", "parquet", "folder", "hf_disk", "hub"]
    path: str | None = Field(
        None, description="File or folder, relative to the study folder or absolute."
    )
    name: str | None = Field(None, description="format hub: the data set's repo id (org/name).")
    config: str | None = Field(None, description="format hub: the data set's config (subset).")
    revision: str | None = Field(
        None, description="format hub: branch, tag or 40-hex commit (default main)."
    )
    splits: list[str] | None = Field(
        None, description="format hub: the data set's splits to read (default: all)."
    )
    glob: str = Field(
        "*.txt", description="File pattern inside each label folder (format: folder)."
    )
    encoding_errors: Literal["error", "replace"] = Field(
        "error",
        description="Invalid UTF-8: error (name file and line) or replace the bytes with U+FFFD.",
    )
    follow_links: bool = Field(
        False,
        description="Read files that symbolic links inside a data folder point to outside it "
        "(each such link is recorded in the snapshot manifest); refused when false.",
    )

    @model_validator(mode="after")
    def _check_source(self) -> SourceConfig:
        hub_fields = [f for f in ("name", "config", "revision", "splits") if getattr(self, f)]
        if self.format == "hub":
            if not self.name or not HUB_ID.fullmatch(self.name):
                raise ValueError("format hub needs data.source.name, a repo id (org/name)")
            if self.path is not None:
                raise ValueError("format hub reads data.source.name: remove data.source.path")
        elif self.path is None:
            raise ValueError(f"format {self.format} needs data.source.path")
        elif hub_fields:
            raise ValueError(f"data.source.{hub_fields[0]} is for format hub only")
        return self


class FieldsConfig(Section):
    id: str | None = Field(
        None, description="Column with a stable example id; content hash when absent."
    )
    text: str = "text"
    label: str | None = "label"
    target: str | None = Field(
        None, description="Column holding the expected answer (format/extraction)."
    )
    split: str | None = Field(
        None, description="Column with the user's own split (train/validation/test)."
    )
    image: str | None = Field(
        None,
        description="image_classification: the column holding each image: jsonl/csv/parquet, "
        "the file's path (relative to the data file's folder); hf_disk/hub, an Image column.",
    )

    @model_serializer(mode="wrap")
    def _drop_unset_image(self, handler: Any) -> dict[str, Any]:
        # absent when unset, so the snapshot ids of text studies keep their sha256
        return without_unset(self, handler, "image")


class CleaningRule(Section):
    rule: Literal[
        "unicode_nfc",
        "unicode_nfkc",
        "normalize_whitespace",
        "strip",
        "drop_empty",
        "drop_longer_than",
        "drop_shorter_than",
        "regex_replace",
        "lowercase",
        "strip_control",
        "unify_labels",
    ]
    max_chars: int | None = None
    min_chars: int | None = None
    pattern: str | None = None
    replacement: str = ""

    @model_validator(mode="after")
    def _check_args(self) -> CleaningRule:
        if self.rule == "drop_longer_than" and self.max_chars is None:
            raise ValueError("drop_longer_than needs max_chars")
        if self.rule == "drop_shorter_than" and self.min_chars is None:
            raise ValueError("drop_shorter_than needs min_chars")
        if self.rule == "regex_replace" and not self.pattern:
            raise ValueError("regex_replace needs pattern")
        return self


class SplitConfig(Section):
    train: float = 0.8
    validation: float = 0.1
    test: float = 0.1
    seed: int = 0
    stratify: bool | Literal["target_kind"] = Field(
        True,
        description="true: every label in every split; target_kind (extraction): every kind "
        "of target (an empty list, a null field) in every split; false: the hash alone.",
    )

    @model_validator(mode="after")
    def _sum_to_one(self) -> SplitConfig:
        total = self.train + self.validation + self.test
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"train + validation + test must sum to 1, got {total:g}")
        if min(self.train, self.validation, self.test) < 0:
            raise ValueError("split fractions must be >= 0")
        return self


class DedupConfig(Section):
    exact: bool = True
    near: bool = True
    threshold: float = Field(0.8, gt=0, le=1, description="Jaccard similarity for near-duplicates.")
    num_perm: int = Field(128, ge=16)
    shingle_size: int = Field(5, ge=1, description="Word shingle length.")
    policy: Literal["drop_eval", "drop_all_but_one", "report_only"] = Field(
        "drop_eval",
        description="drop_eval: a validation/test row duplicating a training row leaves evaluation.",
    )


class DataConfig(Section):
    source: SourceConfig
    fields: FieldsConfig = FieldsConfig()
    cleaning: list[CleaningRule] = []
    splits: SplitConfig = SplitConfig()
    dedup: DedupConfig = DedupConfig()
    max_examples: int | None = Field(
        None, description="Keep at most this many rows (seeded sample)."
    )
    invalid_targets: Literal["refuse", "keep"] = Field(
        "refuse",
        description="Gold targets of a format/extraction task that break its JSON or schema: "
        "refuse (list the rows) or keep (noted in the manifest).",
    )
