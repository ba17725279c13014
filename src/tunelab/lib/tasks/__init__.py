"""Task kinds behind one interface: `get_task(cfg, labels) -> Task`.

- classification (`ClassificationTask`): the target is the label;
- format (`FormatTask`): the answer must match a JSON Schema or a regular expression;
- extraction (`ExtractionTask`): the answer is a JSON object with the schema's required fields,
  scored path by path (`schema_scoring`).

`get_task(cfg, labels) -> Task` (`kind`, `labels`, `render(example) -> (input_text,
target_text)`, `parse(raw_output) -> dict`, `verdicts(parsed, example) -> dict`,
`metric_names`; for inspect `categories(rows)` and `target_problems(rows)`); `task_for(task_cfg,
labels)` is the same for a task section alone (a locked one). `task_problems(task_cfg) -> [str]`
(a json_schema that is no JSON Schema, scoring options naming no path) and
`task_warnings(task_cfg) -> [str]` (json_schema `format` keywords, which nothing checks):
`tunelab validate` reports both, `register` refuses the problems.

`parse(raw)` returns `{"valid", "failure" (None | "empty" | "not_a_label" | "parse_error" |
"not_an_object" | "schema_error" | "no_match"), "error", "value", ...}`; classification adds
`label`; extraction adds `json_valid`, `schema_valid`, `fields` {name: value}, `present` {name:
bool}, `json_failure` (the reader's kind or None). Extraction's `verdicts` hold `correct`,
`json_valid`, `schema_valid`, `failure`, `json_failure`, `paths` {path: counts},
`exact_match`, `all_fields_match`. `ExtractionTask.fields` (top-level required fields),
`ExtractionTask.paths` ([{path, kind}] of the schema), `ClassificationTask.label_to_index`.
Config: `task.scoring {ordered: [path], tolerance: {path: float}}`,
`data.splits.stratify: true | false | target_kind`.
"""

from __future__ import annotations

from tunelab.core.config import StudyConfig
from tunelab.core.config_sections import TaskConfig
from tunelab.core.errors import ConfigError, DataError
from tunelab.lib.tasks.base import Task
from tunelab.lib.tasks.classification import ClassificationTask
from tunelab.lib.tasks.extraction import ExtractionTask
from tunelab.lib.tasks.format import FormatTask
from tunelab.lib.tasks.json_text import FoundJson, find_json_object

__all__ = [
    "ClassificationTask",
    "ExtractionTask",
    "FormatTask",
    "FoundJson",
    "Task",
    "find_json_object",
    "get_task",
    "task_for",
    "task_problems",
    "task_warnings",
]


def _resolve_labels(configured: list[str] | None, found: list[str] | None) -> list[str]:
    if configured:
        if len(set(configured)) != len(configured):
            raise ConfigError(
                f"task.labels has duplicates: {configured}",
                hint="list each label once in task.labels",
            )
        unknown = sorted(set(found or []) - set(configured))
        if unknown:
            raise DataError(
                f"the data has labels not in task.labels: {unknown}",
                hint="add them to task.labels in study.yaml, or drop those rows with a "
                "cleaning rule, then rebuild the snapshot with `tunelab data`",
            )
        labels = list(configured)
    else:
        labels = sorted({str(x) for x in (found or [])})
    if len(labels) < 2:
        raise ConfigError(
            f"a classification task needs at least 2 labels, found {labels}",
            hint="set task.labels in study.yaml, or check data.fields.label",
        )
    return labels


def get_task(cfg: StudyConfig, labels: list[str] | None = None) -> Task:
    """The task of a study. `labels`: the label set found in the data (classification)."""
    return task_for(cfg.task, labels)


def task_for(t: TaskConfig, labels: list[str] | None = None) -> Task:
    """The task a task section describes (a study's, or one a hypothesis locked)."""
    if t.kind == "classification":
        return ClassificationTask(_resolve_labels(t.labels, labels), t.instruction)
    if t.kind == "image_classification":
        from tunelab.lib.tasks.image_classification import ImageClassificationTask

        return ImageClassificationTask(_resolve_labels(t.labels, labels), t.instruction)
    if t.kind == "format":
        return FormatTask(t.instruction, t.json_schema, t.regex)
    if t.kind == "extraction":
        assert t.json_schema is not None  # checked by TaskConfig
        scoring = t.scoring
        return ExtractionTask(
            t.instruction,
            t.json_schema,
            ordered=scoring.ordered if scoring else (),
            tolerance=scoring.tolerance if scoring else None,
        )
    raise ConfigError(f"unknown task.kind {t.kind!r}")  # pragma: no cover - config validates


def task_problems(t: TaskConfig) -> list[str]:
    """What the task section cannot be built with, checked before any data or model is read
    (`tunelab validate`, `tunelab register`): a task.json_schema that is no JSON Schema, and
    task.scoring options naming no path of it. Classification labels come from the data."""
    if t.kind not in ("format", "extraction"):
        return []
    try:
        task_for(t)
    except ConfigError as exc:
        return [exc.message + (f" ({exc.hint})" if exc.hint else "")]
    return []


def _formats(node: object, path: str) -> list[tuple[str, str]]:
    """(schema path, format) of every `format` keyword under `node`."""
    out = []
    if isinstance(node, dict):
        if isinstance(node.get("format"), str):
            out.append((path or "(root)", node["format"]))
        for key, value in node.items():
            out += _formats(value, f"{path}/{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _formats(value, f"{path}/{i}")
    return out


def task_warnings(t: TaskConfig) -> list[str]:
    """Settings of the task section that are read but not enforced: a json_schema `format`
    (JSON Schema makes it an annotation; neither the gold check nor validity tests it)."""
    found = _formats(t.json_schema, "") if t.json_schema else []
    if not found:
        return []
    shown = ", ".join(f"{where} ({fmt!r})" for where, fmt in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return [
        f"task.json_schema: format is not checked at {shown}{more}: JSON Schema treats it as "
        "an annotation, so a gold target or an answer in another form still counts as valid; "
        "add a `pattern` to the same field to enforce a form"
    ]
