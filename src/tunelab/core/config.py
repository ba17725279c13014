"""The typed study config: one section per protocol stage, validated all at once.

`load_config(path, overrides)` reads study.yaml, applies `--set key.path=value` overrides and
returns a `StudyConfig`, or raises one `ConfigError` listing every problem (field path, value
found, what is expected). Unknown keys are errors.

- `StudyConfig` (pydantic) has the sections `task hypothesis guardrails data model adaptation
  preprocess training evaluation budget`. Every section is strict (no "4" -> 4, no "false" ->
  False; lists stand for tuples): a new field takes its value's own type.
- `cfg.evaluation_spec()` is what the hypothesis locks; it leaves out `EVALUATION_SPEED_FIELDS`
  (`evaluation.num_threads`). `cfg.hub_refs()` names the hub repos the study uses.
- `sha256_json(obj)` hashes canonical JSON.
- `contradictions(cfg) -> [str]` (warm-up past max_steps, `generation_room_problem(cfg)`) and
  `config_warnings(cfg) -> [str]` (settings the method ignores) are what `tunelab validate`
  reports through `tunelab.stages.hypothesis.validate.validate_study`.
- `resolve_path(text, root=None)`: a path from a config (`asset:NAME[/sub]`, `~`, relative to
  the study).
- `CLASSIFYING_KINDS`: the kinds scored as classification; test `cfg.task.kind` against it, not
  against "classification". `data.fields.image`, `preprocess.image` (`ImageTransformsConfig`)
  and `task.scoring` are absent from the dump when unset.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tunelab.core.errors import ConfigError, preview
from tunelab.core.hashing import sha256_json
from tunelab.core.strict_load import ParseProblem, load_yaml

# a hub repo id: "org/name" (or a bare legacy "name"), as huggingface_hub accepts it
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")

TaskKind = Literal["classification", "format", "extraction", "image_classification"]
# kinds scored as classification (a label per example, per-category metrics)
CLASSIFYING_KINDS = ("classification", "image_classification")


def _without_unset(model: BaseModel, handler: Any, field: str) -> dict[str, Any]:
    """The model serialized without `field` when it is None."""
    out = handler(model)
    if getattr(model, field) is None:
        out.pop(field, None)
    return out


def _without_defaults(model: BaseModel, handler: Any, fields: tuple[str, ...]) -> dict[str, Any]:
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
        return _without_defaults(self, handler, ("goal", "equivalence_margin"))

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
        return _without_defaults(self, handler, ("test",))

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
        return _without_unset(self, handler, "scoring")

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
        return _without_unset(self, handler, "image")


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


# ---------------------------------------------------------------- model and adaptation


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local transformers folder, or a folder holding gguf_file."
    )
    gguf_file: str | None = Field(
        None, description="GGUF file inside path (or in the hub repo), converted once to a cache."
    )
    name: str | None = Field(
        None,
        description="Hub repo id (org/name) when path is absent; with path, the base's human name.",
    )
    revision: str | None = Field(
        None, description="Hub branch, tag or 40-hex commit of name (default main); hub only."
    )
    allow_pickle: bool = Field(
        False, description="Hub repo without safetensors: load its *.bin / *.pt pickles."
    )
    architecture: Literal["auto", "encoder", "causal_lm", "image"] = "auto"
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @property
    def hub_id(self) -> str | None:
        """The hub repo id when the base comes from the hub (name without path), else None."""
        return self.name if self.path is None else None

    @model_validator(mode="after")
    def _check_source(self) -> ModelConfig:
        if self.path is None and not self.name:
            raise ValueError("set model.path (a local folder) or model.name (a hub repo id)")
        if self.path is not None and self.revision is not None:
            raise ValueError(
                "model.path and model.revision: choose one (a local folder is pinned by its "
                "files' sha256; a revision pins a hub repo named by model.name without path)"
            )
        if self.path is None and not HUB_ID.fullmatch(self.name or ""):
            raise ValueError(
                f"model.name {self.name!r} is not a hub repo id (org/name); for a local folder "
                "set model.path"
            )
        return self


class QuantizationConfig(Section):
    """qlora: how bitsandbytes stores the frozen base (4 bits) and computes with it."""

    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type of the base.")
    double_quant: bool = Field(
        True, description="Quantize the block-wise scales too (about 0.4 bit per weight less)."
    )
    compute_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16", description="dtype the 4-bit weights are dequantized to for each matmul."
    )


class AdaptationConfig(Section):
    method: Literal["full", "lora", "freeze", "qlora"] = Field(
        "lora", description="qlora: LoRA on a base loaded in 4 bits (bitsandbytes)."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )
    rank: int = Field(8, ge=1)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0, lt=1)
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Extra modules trained and saved in full, e.g. a classifier head.",
    )
    trainable: list[str] = Field(
        default_factory=list,
        description="freeze: names (substrings) of the modules left trainable.",
    )
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="qlora: the 4-bit base's settings."
    )

    @model_validator(mode="after")
    def _check_method(self) -> AdaptationConfig:
        if self.method == "freeze" and not self.trainable:
            raise ValueError("method 'freeze' needs adaptation.trainable (modules left trainable)")
        return self


# ---------------------------------------------------------------- preprocessing


class ImageTransformsConfig(Section):
    """image_classification: the transform chain; unset sizes and statistics come from the
    base model's image processor (preprocessor_config.json)."""

    resize: int | None = Field(
        None, ge=1, description="Resize to this square size in pixels (processor's size if unset)."
    )
    crop: int | None = Field(
        None, ge=1, description="Center crop to this square size (processor's crop_size if set)."
    )
    mean: list[float] | None = Field(None, description="Per-channel mean (processor's if unset).")
    std: list[float] | None = Field(None, description="Per-channel std (processor's if unset).")
    train_random_crop: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Training only: crop a random square of this share of the side, then resize.",
    )
    train_flip: bool = Field(False, description="Training only: random horizontal flip.")


class PreprocessConfig(Section):
    max_seq_len: int = Field(256, ge=8)
    template: Literal["chat", "plain"] = Field(
        "chat", description="chat: the tokenizer's chat template; plain: plain_template."
    )
    plain_template: str = Field(
        "{instruction}\n\n### Input:\n{input}\n\n### Answer:\n",
        description="Prompt template with {instruction} and {input}; the target follows it.",
    )
    truncation_side: Literal["left", "right"] = Field(
        "right", description="Which side of the prompt input is cut when too long."
    )
    train_on_prompt: bool = False
    allow_target_truncation: bool = False
    image: ImageTransformsConfig | None = Field(
        None, description="image_classification: resize, crop, normalize, training augmentation."
    )
    instruction_role: Literal["user", "system"] = Field(
        "user",
        description="Chat turn holding task.instruction; system falls back to the user turn "
        "(with a note) where the template refuses a system role.",
    )
    chat_template_kwargs: dict[str, bool | int | float | str] | None = Field(
        None, description="Arguments of the chat template, e.g. {enable_thinking: false}."
    )

    @model_serializer(mode="wrap")
    def _drop_unset_image(self, handler: Any) -> dict[str, Any]:
        # absent when unset, so the locked evaluation specs of text studies keep their sha256
        out = _without_unset(self, handler, "image")
        out = {k: v for k, v in out.items() if k != "chat_template_kwargs" or v is not None}
        if out.get("instruction_role") == "user":
            out.pop("instruction_role")
        return out


# ---------------------------------------------------------------- training


class TrainingConfig(Section):
    seed: int = 0
    micro_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides num_epochs.")
    num_epochs: float = Field(1.0, gt=0)
    optimizer: str = Field(
        "AdamW",
        description="Any torch.optim optimizer by name, or AdamW8bit / PagedAdamW8bit "
        "(bitsandbytes, the qlora extra).",
    )
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = 0.0
    betas: Annotated[tuple[StrictFloat, StrictFloat], Field(strict=False)] = (0.9, 0.999)
    schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float | None = 1.0
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast on a CUDA device with bf16, else fp32."
    )
    compile: bool = Field(False, description="torch.compile each decoder block.")
    attention: Literal["auto", "flash_varlen", "torch_varlen", "flex", "per_example"] = Field(
        "auto", description="Attention of packed rows; auto: the best that runs here and is exact."
    )
    activation_checkpointing: bool = False
    packing: bool = Field(True, description="Padding-free batches for causal LMs where exact.")
    eval_every_steps: int | None = None
    checkpoint_every_steps: int | None = None
    keep_last_checkpoints: int = Field(2, ge=1)
    update_check_steps: int = Field(
        2, ge=1, description="Steps after which every trainable tensor must have moved."
    )
    num_threads: int | None = None
    log_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Live mirrors of the step metrics: tensorboard (event files in the run "
        "folder), mlflow (the server or store named by MLFLOW_TRACKING_URI), wandb (WANDB_* "
        "settings).",
    )

    @model_validator(mode="after")
    def _check_log_to(self) -> TrainingConfig:
        if len(set(self.log_to)) != len(self.log_to):
            raise ValueError(f"training.log_to names a backend twice: {self.log_to}")
        return self


class EvaluationConfig(Section):
    split: Literal["validation", "test"] = "validation"
    batch_size: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    decoding: Literal["greedy"] = "greedy"
    seed: int = 0
    max_examples: int | None = Field(
        None, description="Evaluate the first N examples of the split."
    )
    bootstrap_samples: int = 1000
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1.0,
        description="Two-sided level of every interval; each one-sided "
        "test (a guardrail, the primary metric) runs at (1 - confidence) / 2.",
    )
    interval_method: Literal["wilson", "bootstrap"] = Field(
        "wilson",
        description="Interval of a rate judged against an absolute bound "
        "(json_valid_rate >= 0.99): Wilson score, or the bootstrap. Deltas always use the "
        "paired bootstrap.",
    )
    multiplicity: Literal["holm", "bonferroni", "none"] = Field(
        "holm", description="Family-wise error control over the guardrail checks of a comparison."
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for inference; unset: the cores free when it starts (the "
        "process's cores less other processes' threads runnable now). Not part of the locked "
        "procedure.",
    )
    draft_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="Tokens a row may propose per decoding step, looked up in its prompt and "
        "the earlier answers, and kept only where greedy decoding agrees (0: `generate`, one "
        "token per step). Speed alone: the outputs are the greedy ones. Not part of the locked "
        "procedure.",
    )

    @model_serializer(mode="wrap")
    def _drop_default_tests(self, handler: Any) -> dict[str, Any]:
        return _without_defaults(self, handler, EVALUATION_TEST_FIELDS)


# the tests a decision runs: locked with the spec, absent from it at their defaults
EVALUATION_TEST_FIELDS = ("confidence", "interval_method", "multiplicity")
# evaluation settings of speed alone: outside the locked evaluation spec
EVALUATION_SPEED_FIELDS = {"num_threads", "draft_tokens"}


class BudgetConfig(Section):
    rental_days: Literal[3, 7, 30] = 7
    gpu_hour_price: float = Field(2.5, ge=0)
    gpu: str = "1x H100 80GB"
    hours_per_day: float = Field(24.0, gt=0, le=24)
    num_variants: int = Field(4, ge=1, description="Experiments the study intends to run.")


class StudyConfig(Section):
    name: str
    task: TaskConfig = TaskConfig()
    hypothesis: HypothesisConfig
    guardrails: list[GuardrailRule]
    data: DataConfig
    model: ModelConfig
    adaptation: AdaptationConfig = AdaptationConfig()
    preprocess: PreprocessConfig = PreprocessConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    budget: BudgetConfig = BudgetConfig()

    @model_validator(mode="after")
    def _check_stratify(self) -> StudyConfig:
        if self.data.splits.stratify == "target_kind" and self.task.kind != "extraction":
            raise ValueError(
                "data.splits.stratify: target_kind needs task.kind: extraction "
                "(other tasks stratify by label: true)"
            )
        images = self.task.kind == "image_classification"
        if images and self.data.cleaning:
            raise ValueError("data.cleaning rules apply to text: remove them for image data")
        if not images and (self.data.fields.image or self.preprocess.image):
            raise ValueError(
                "data.fields.image and preprocess.image need task.kind: image_classification"
            )
        if images and self.model.architecture not in ("auto", "image"):
            raise ValueError(
                f"model.architecture {self.model.architecture}: image_classification needs an "
                "image model (architecture auto or image)"
            )
        if not images and self.model.architecture == "image":
            raise ValueError("model.architecture image needs task.kind: image_classification")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def sha256(self) -> str:
        return sha256_json(self.to_dict())

    def hub_refs(self) -> dict[str, dict[str, str]]:
        """The hub repos the study reads, by key ("model", "data"): repo_id, repo_type, revision."""
        refs = {}
        if self.model.hub_id:
            refs["model"] = {
                "repo_id": self.model.hub_id,
                "repo_type": "model",
                "revision": self.model.revision or "main",
            }
        src = self.data.source
        if src.format == "hub" and src.name:
            refs["data"] = {
                "repo_id": src.name,
                "repo_type": "dataset",
                "revision": src.revision or "main",
            }
        return refs

    def evaluation_spec(self) -> dict[str, Any]:
        """What an evaluation depends on; locked with the hypothesis so every variant uses it."""
        return {
            "task": self.task.model_dump(mode="json"),
            "evaluation": self.evaluation.model_dump(mode="json", exclude=EVALUATION_SPEED_FIELDS),
            "preprocess": self.preprocess.model_dump(mode="json"),
        }


# ---------------------------------------------------------------- loading


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=2e-4' -> (['train', 'lr'], 0.0002). The value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(
            f"--set {preview(item)} has no '='",
            hint="write --set section.field=value, e.g. --set training.lr=1e-4",
        )
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(
            f"--set {preview(item)} has an empty key", hint="e.g. --set training.lr=1e-4"
        )
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except ParseProblem:
        value = raw  # not YAML: the text itself, checked against the field's type
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    given: dict[tuple[str, ...], str] = {}
    for item in overrides:
        path, value = parse_override(item)
        key = tuple(path)
        # a later --set would silently win over an earlier one of the same key (or its section)
        clash = next(
            (seen for k, seen in given.items() if k[: len(key)] == key or key[: len(k)] == k),
            None,
        )
        if clash is not None:
            raise ConfigError(
                f"--set {preview(clash)} and --set {preview(item)} set {'.'.join(path)} twice",
                hint="give each setting once with --set",
            )
        given[key] = item
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return out


def override_sources(text: str, overrides: Sequence[str]) -> list[str]:
    """The `--set` items whose key `text` names (a problem names its fields by path:
    `training.max_steps`, `data.source.path`, `guardrails[0].metric`)."""
    found = []
    for item in overrides:
        key = ".".join(p for p in item.partition("=")[0].strip().split(".") if p)
        if "=" in item and key and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", text):
            found.append(item)
    return found


def sourced_problems(
    problems: Sequence[str], source: str, overrides: Sequence[str]
) -> tuple[str, list[str], str]:
    """(where, lines, what to change) for problems found in a config loaded from `source` with
    `overrides`: each line names the `--set` items it comes from, and `where` is `source`,
    `--set`, or both, so the user edits the place the value was written."""
    origins = [override_sources(p, overrides) for p in problems]
    lines = [
        f"  - {p}" + "".join(f" (from --set {item})" for item in items)
        for p, items in zip(problems, origins, strict=True)
    ]
    name = Path(source).name
    from_set = sum(1 for items in origins if items)
    if from_set and from_set == len(problems):
        return "--set", lines, "the --set values named above"
    if from_set:
        return f"{source} and --set", lines, f"the --set values and the {name} settings named above"
    return source, lines, f"the settings named in {name}"


def _reads_as_scalar(text: str) -> bool:
    try:
        value = load_yaml(text)
    except ParseProblem:
        return False
    return isinstance(value, int | float | bool)


# keys that other fine-tuning tools (peft, Trainer, Axolotl) spell otherwise: what tunelab reads
FAMILIAR_KEYS = {
    "adaptation.quantization.bits": "QLoRA stores the base in 4 bits only; its data type is "
    "adaptation.quantization.quant_type (nf4 or fp4)",
    "adaptation.load_in_4bit": "a 4-bit base is adaptation.method: qlora",
    "adaptation.load_in_8bit": "8-bit bases are not supported; adaptation.method: qlora "
    "loads the base in 4 bits",
    "adaptation.r": "the LoRA rank is adaptation.rank",
    "adaptation.lora_r": "the LoRA rank is adaptation.rank",
    "adaptation.lora_alpha": "it is adaptation.alpha",
    "adaptation.lora_dropout": "it is adaptation.dropout",
    "training.learning_rate": "it is training.lr",
    "training.gradient_accumulation_steps": "it is training.grad_accum_steps",
    "training.per_device_train_batch_size": "it is training.micro_batch_size",
}


def _describe_error(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    value = err.get("input")
    shown = preview(value) if err["type"] != "missing" else "(missing)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        from tunelab.core.config_keys import shown_key, unknown_key_message

        hint = "check the spelling; `tunelab init` writes every known key"
        msg = (
            f"unknown key ({FAMILIAR_KEYS[loc]})"
            if loc in FAMILIAR_KEYS
            else unknown_key_message(StudyConfig, list(err["loc"]), hint)
        )
        loc = shown_key(loc)
    elif err["type"] == "finite_number":
        msg = "must be a finite number (NaN and infinity are refused)"
    elif err["type"].endswith("_type") and isinstance(value, str):
        msg += " (found text"
        if value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
            msg += "; a finite number is needed: NaN and infinity are refused"
        elif _reads_as_scalar(value):  # a quoted number or boolean
            msg += f"; write {value.strip()} without quotes if it is meant as a value"
        msg += ")"
    if isinstance(value, dict) and err["type"] == "value_error":
        # a check across fields names them itself; the whole section would say nothing more
        return f"  - {loc or 'study'}: {msg}"
    return f"  - {loc or '(top level)'}: {msg}; found {shown}"


def generation_room_problem(cfg: StudyConfig) -> str | None:
    """A generating task's prompt is cut to leave room for `max_new_tokens`: a budget as long
    as the window leaves none for the input."""
    ev, pre = cfg.evaluation, cfg.preprocess
    if cfg.task.kind in CLASSIFYING_KINDS or ev.max_new_tokens < pre.max_seq_len:
        return None
    return (
        f"evaluation.max_new_tokens ({ev.max_new_tokens}) must be below "
        f"preprocess.max_seq_len ({pre.max_seq_len}): the prompt is cut to leave room for the "
        "generated tokens, so none would be left for the input"
    )


def contradictions(cfg: StudyConfig) -> list[str]:
    """Settings that each make sense alone but contradict another (`tunelab validate` refuses
    them; a stage that depends on one refuses it too): `field: why` per problem."""
    out = []
    t = cfg.training
    if t.max_steps is not None and t.warmup_steps > t.max_steps:
        out.append(
            f"training.warmup_steps: {t.warmup_steps} warm-up steps exceed training.max_steps "
            f"({t.max_steps}): the learning rate would never reach training.lr"
        )
    room = generation_room_problem(cfg)
    return out + ([room] if room else [])


_LORA_ONLY = ("rank", "alpha", "dropout", "target_modules")
_IGNORED = {
    "lora": ("trainable", "quantization"),
    "qlora": ("trainable",),
    "full": (*_LORA_ONLY, "trainable", "quantization"),
    "freeze": (*_LORA_ONLY, "quantization"),
}


_USER = {"trainable": "only freeze uses it", "quantization": "only qlora uses it"}


def config_warnings(cfg: StudyConfig) -> list[str]:
    """Settings written in study.yaml that the chosen adaptation method ignores."""
    a = cfg.adaptation
    return [
        f"adaptation.{name} ({preview(getattr(a, name))}) is ignored: adaptation.method is "
        f"{a.method!r} ({_USER.get(name, 'only LoRA and QLoRA use it')})"
        for name in _IGNORED.get(a.method, ())
        if name in a.model_fields_set
    ]


def _override_of(err: dict[str, Any], overrides: Mapping[tuple[str, ...], str]) -> str | None:
    """The `--set` item an error comes from: its value, or an unknown key it introduced."""
    loc = tuple(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    for path, item in overrides.items():
        if loc[: len(path)] == path or (
            err["type"] == "extra_forbidden" and path[: len(loc)] == loc
        ):
            return item
    return None


def validate_config(
    raw: Any, source: str = "study.yaml", overrides: Mapping[tuple[str, ...], str] | None = None
) -> StudyConfig:
    """`overrides`: {field path: the `--set` item that wrote it}, so an error names its source."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of sections, found {type(raw).__name__}",
            hint="start from `tunelab init DIR --task classification`",
        )
    try:
        cfg = StudyConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        origins = [_override_of(e, overrides or {}) for e in errors]
        lines = [
            _describe_error(e) + (f" (from --set {item})" if item else "")
            for e, item in zip(errors, origins, strict=True)
        ]
        from_set = sum(1 for item in origins if item)
        where = (
            "--set" if from_set == len(errors) else (f"{source} and --set" if from_set else source)
        )
        raise ConfigError(
            f"{where}: {len(errors)} problem(s):\n" + "\n".join(lines),
            hint="fix each field above (a --set key is section.field, as in study.yaml), then "
            "run `tunelab validate`"
            if from_set
            else "fix each field above, then run `tunelab validate`",
        ) from None
    return cfg


_REFUSED_HINTS = {
    "given twice": "keep one of the two (YAML keeps only the last, silently, elsewhere)",
    "expands": "write the values out, or use fewer aliases",
    "refers to itself": "an alias cannot be used inside its own anchor",
    "nested": "flatten the value",
}


def resolve_path(text: str, root: Path | None = None) -> Path:
    """A path from a config: `asset:NAME[/sub/path]` names a packaged asset (portable studies),
    `~` is expanded, and a relative path is taken under `root` (the study folder)."""
    if text.startswith("asset:"):
        from tunelab.core.assets import asset_path

        return asset_path(text)
    p = Path(os.path.expanduser(text))
    return p if p.is_absolute() or root is None else Path(root) / p


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"{path}: no such file", hint="create a study with `tunelab init DIR`")
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except ParseProblem as exc:
        where = f" {exc.place()}:" if exc.line else ""
        hint = next((h for k, h in _REFUSED_HINTS.items() if k in exc.problem), None)
        raise ConfigError(
            f"{path}:{where} {exc.problem}",
            hint=hint or "fix the YAML syntax (indentation, colons, quotes)",
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})", hint="save the file as UTF-8"
        ) from None
    return raw if raw is not None else {}


def load_config(path: Path, overrides: list[str] | None = None) -> StudyConfig:
    raw = read_yaml(path)
    if overrides:
        if not isinstance(raw, dict):
            raw = {}
        raw = apply_overrides(raw, overrides)
    origin = {tuple(parse_override(o)[0]): o for o in overrides or []}
    return validate_config(raw, source=str(path), overrides=origin)
