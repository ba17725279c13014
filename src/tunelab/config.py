"""The typed study config: one section per protocol stage, validated all at once.

`load_config(path, overrides)` reads study.yaml, applies `--set key.path=value` overrides and
returns a `StudyConfig`, or raises one `ConfigError` listing every problem (field path, value
found, what is expected). Unknown keys are errors.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tunelab.errors import ConfigError

TaskKind = Literal["classification", "format", "extraction"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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

    def describe(self) -> str:
        bound = f"baseline {self.value:+g}" if self.relative_to else f"{self.value:g}"
        where = {"overall": "", "every_category": "per-category ", "every_field": "per-field "}[
            self.scope
        ]
        return f"{where}{self.metric} {self.op} {bound}"


# ---------------------------------------------------------------- task


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

    @model_validator(mode="after")
    def _check_kind(self) -> TaskConfig:
        if self.kind == "format" and (self.json_schema is None) == (self.regex is None):
            raise ValueError("a format task needs exactly one of task.json_schema or task.regex")
        if self.kind == "extraction":
            if not self.json_schema or not self.json_schema.get("required"):
                raise ValueError(
                    "an extraction task needs task.json_schema with a non-empty 'required' list"
                )
        return self


# ---------------------------------------------------------------- data


class SourceConfig(Section):
    format: Literal["jsonl", "csv", "parquet", "folder", "hf_disk"]
    path: str = Field(description="File or folder, relative to the study folder or absolute.")
    glob: str = Field(
        "*.txt", description="File pattern inside each label folder (format: folder)."
    )
    encoding_errors: Literal["error", "replace"] = Field(
        "error",
        description="Invalid UTF-8: error (name file and line) or replace the bytes with U+FFFD.",
    )


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
    stratify: bool = True

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


# ---------------------------------------------------------------- model and adaptation


class ModelConfig(Section):
    path: str = Field(description="Local transformers folder, or a folder holding gguf_file.")
    gguf_file: str | None = Field(
        None, description="GGUF file inside path, converted once to a cache."
    )
    name: str | None = Field(
        None, description="Human name of the base, e.g. HuggingFaceTB/SmolLM2-135M-Instruct."
    )
    revision: str | None = None
    architecture: Literal["auto", "encoder", "causal_lm"] = "auto"
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class AdaptationConfig(Section):
    method: Literal["full", "lora", "freeze"] = "lora"
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

    @model_validator(mode="after")
    def _check_method(self) -> AdaptationConfig:
        if self.method == "freeze" and not self.trainable:
            raise ValueError("method 'freeze' needs adaptation.trainable (modules left trainable)")
        return self


# ---------------------------------------------------------------- preprocessing


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


# ---------------------------------------------------------------- training


class TrainingConfig(Section):
    seed: int = 0
    micro_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides num_epochs.")
    num_epochs: float = Field(1.0, gt=0)
    optimizer: str = Field("AdamW", description="Any torch.optim optimizer by name.")
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
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

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def sha256(self) -> str:
        return sha256_json(self.to_dict())

    def evaluation_spec(self) -> dict[str, Any]:
        """What an evaluation depends on; locked with the hypothesis so every variant uses it."""
        return {
            "task": self.task.model_dump(mode="json"),
            "evaluation": self.evaluation.model_dump(mode="json"),
            "preprocess": self.preprocess.model_dump(mode="json"),
        }


# ---------------------------------------------------------------- loading


def sha256_json(obj: Any) -> str:
    """sha256 of the canonical JSON form (sorted keys, no spaces)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=2e-4' -> (['train', 'lr'], 0.0002). The value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(
            f"--set {item!r} has no '='",
            hint="write --set section.field=value, e.g. --set training.lr=1e-4",
        )
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {item!r} has an empty key", hint="e.g. --set training.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return out


def _describe_error(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    value = err.get("input")
    shown = json.dumps(value, default=str)[:80] if err["type"] != "missing" else "(missing)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; `tunelab init` writes every known key)"
    if isinstance(value, dict) and err["type"] == "value_error":
        # a check across fields names them itself; the whole section would say nothing more
        return f"  - {loc or 'study'}: {msg}"
    return f"  - {loc or '(top level)'}: {msg}; found {shown}"


def validate_config(raw: Any, source: str = "study.yaml") -> StudyConfig:
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of sections, found {type(raw).__name__}",
            hint="start from `tunelab init DIR --task classification`",
        )
    try:
        return StudyConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_describe_error(e) for e in errors]
        raise ConfigError(
            f"{source}: {len(errors)} problem(s):\n" + "\n".join(lines),
            hint="fix each field above, then run `tunelab validate`",
        ) from None


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"{path}: no such file", hint="create a study with `tunelab init DIR`")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"{path}:{where} is not valid YAML: {getattr(exc, 'problem', exc)}",
            hint="fix the YAML syntax (indentation, colons, quotes)",
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
    return validate_config(raw, source=str(path))
