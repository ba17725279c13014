"""The typed study config: one section per protocol stage, validated all at once.

`load_config(path, overrides)` reads study.yaml, applies `--set key.path=value` overrides and
returns a `StudyConfig`, or raises one `ConfigError` listing every problem (field path, value
found, what is expected). Unknown keys are errors.

- `StudyConfig` (pydantic) has the sections `task hypothesis guardrails data model adaptation
  preprocess training evaluation budget`, defined in `config_sections` (the question and the
  data) and `config_training` (the model and its training). Every section is strict (no "4" ->
  4, no "false" -> False; lists stand for tuples): a new field takes its value's own type.
- `cfg.evaluation_spec()` is what the hypothesis locks; it leaves out `EVALUATION_SPEED_FIELDS`
  (`evaluation.num_threads`). `cfg.hub_refs()` names the hub repos the study uses.
- `contradictions(cfg) -> [str]` (warm-up past max_steps, `generation_room_problem(cfg)`) and
  `config_warnings(cfg) -> [str]` (settings the method ignores) are what `tunelab validate`
  reports through `tunelab.stages.hypothesis.validate.validate_study`.
- `resolve_path(text, root=None)`: a path from a config (`asset:NAME[/sub]`, `~`, relative to
  the study).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from tunelab.core.config_sections import (
    CLASSIFYING_KINDS,
    DataConfig,
    GuardrailRule,
    HypothesisConfig,
    Section,
    TaskConfig,
)
from tunelab.core.config_training import (
    EVALUATION_SPEED_FIELDS,
    AdaptationConfig,
    BudgetConfig,
    EvaluationConfig,
    ModelConfig,
    PreprocessConfig,
    TrainingConfig,
)
from tunelab.core.errors import ConfigError, preview
from tunelab.core.hashing import sha256_json
from tunelab.core.strict_load import ParseProblem, load_yaml


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
