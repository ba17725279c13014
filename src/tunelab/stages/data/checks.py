"""The checks `tunelab data` runs on the rows it read, before any cleaning: one list, in order.

Each check takes the rows read (with the study config) and returns notes for the manifest, or
raises DataError naming the row (file and line), the field and the fix. A new check is one
function appended to `SOURCE_CHECKS`.

- `check_label_spellings`: labels that differ only by case, surrounding spaces, or by being
  written as a number in some rows and as text in others; refused unless `unify_labels` is a
  cleaning rule, which gives each such label one spelling.
- `check_labels`: every label is one of task.labels.
- `check_targets`: gold answers of format and extraction tasks that are not valid JSON, break
  task.json_schema, or do not match task.regex (refused unless data.invalid_targets: keep).

`control_notes` runs on the cleaned texts: control characters and ANSI escape sequences are
warned with example places (the `strip_control` cleaning rule removes them).

`RowsRead(rows, config, source_path)` (with `task_labels`, `has_label`) is what each check reads.
"""

from __future__ import annotations

import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.errors import DataError, preview
from tunelab.core.strict_load import ParseProblem, loads_json
from tunelab.stages.data.cleaning import CONTROL
from tunelab.stages.data.source_files import SourceRow

SHOWN_ROWS = 10  # rows named in a message; the count says how many in all
SHOWN_PLACES = 3  # rows named per label spelling
MAX_LABEL_CHARS = 200


@dataclass(frozen=True)
class RowsRead:
    """What a check sees: the source rows, in source order, and the study's config."""

    rows: list[SourceRow]
    config: StudyConfig
    source_path: Path

    @property
    def task_labels(self) -> list[str] | None:
        """task.labels sorted, or None when the labels are read from the data."""
        labels = self.config.task.labels
        return sorted(labels) if labels else None

    @property
    def has_label(self) -> bool:
        """Whether the rows carry a label (a label field, or one folder per label)."""
        data = self.config.data
        return data.fields.label is not None or data.source.format == "folder"


Check = Callable[[RowsRead], list[str]]


def check_not_empty(read: RowsRead) -> list[str]:
    if not read.rows:
        raise DataError(
            f"{read.source_path}: the data set is empty (no rows)",
            hint="point data.source.path at the data, or check data.source.format and glob",
        )
    return []


def check_labels(read: RowsRead) -> list[str]:
    """Every label is one of task.labels (when set); a task label without a row is noted."""
    known = read.task_labels
    if not read.has_label or not known:
        return []
    allowed = set(known)
    for row in read.rows:
        if row.label not in allowed:
            raise DataError(
                f"{row.where}: unknown label {row.label!r} (field label); task.labels "
                f"lists {sorted(allowed)}",
                hint="fix the row, or add the label to task.labels in study.yaml",
            )
    missing = sorted(allowed - {r.label for r in read.rows})
    return [f"labels in task.labels with no example: {missing}"] if missing else []


def _places(rows: list[SourceRow], limit: int = SHOWN_PLACES) -> str:
    shown = ", ".join(r.where for r in rows[:limit])
    return shown + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def _spelling(raw: Any) -> str:
    """The label as written; escaped when it is not ASCII, so that spellings that differ by
    Unicode form or an invisible character do not print alike."""
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return repr(str(raw)) if str(raw).isascii() else ascii(str(raw))
    return f"{raw!r} (a number)"


def label_key(label: str) -> str:
    """What two spellings of one label share: Unicode compatibility form (NFKC), invisible
    characters (format category Cf: zero-width spaces and joiners, soft hyphens, BOMs) removed,
    runs of whitespace as one space, case folded."""
    text = unicodedata.normalize("NFKC", label)
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return " ".join(text.split()).casefold()


def label_spellings(
    rows: list[SourceRow], task_labels: list[str] | None
) -> dict[str, dict[str, list[SourceRow]]]:
    """Labels that several spellings share, by case-folded label: {spelling: rows}.

    A spelling is the label as written: text and number apart, spaces kept. A label of
    task.labels is one spelling (with no rows) when a data label matches it only by case.
    """
    groups: dict[str, dict[str, list[SourceRow]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.label is not None:
            raw = row.label if row.label_raw is None else row.label_raw
            groups[label_key(row.label)][_spelling(raw)].append(row)
    for label in task_labels or []:
        if label_key(label) in groups and _spelling(label) not in groups[label_key(label)]:
            groups[label_key(label)][_spelling(label)] = []
    return {k: dict(v) for k, v in groups.items() if len(v) > 1}


def _canonical(key: str, rows: list[SourceRow], task_labels: list[str] | None) -> str:
    """task.labels' spelling of the label, else its most frequent one (ties: the first sorted)."""
    for label in task_labels or []:
        if label_key(label) == key:
            return label
    counts = Counter(r.label for r in rows)
    return min(counts, key=lambda lab: (-counts[lab], lab))


def check_label_spellings(read: RowsRead) -> list[str]:
    """Refuse labels spelt several ways, or (cleaning rule `unify_labels`) give each one
    spelling: task.labels' own, else its most frequent (ties: the first sorted)."""
    if not read.has_label:
        return []
    rows, task_labels = read.rows, read.task_labels
    _refuse_long_labels(rows)
    variants = label_spellings(rows, task_labels)
    if not any(r.rule == "unify_labels" for r in read.config.data.cleaning):
        if variants:
            raise _variants_error(variants)
        return []
    by_key: dict[str, list[SourceRow]] = defaultdict(list)
    for row in rows:
        if row.label is not None:
            by_key[label_key(row.label)].append(row)
    for key, members in by_key.items():
        label = _canonical(key, members, task_labels)
        for row in members:
            row.label = label
    return []


def _refuse_long_labels(rows: list[SourceRow]) -> None:
    """A label longer than MAX_LABEL_CHARS is a text or a path in the label column, not a
    category."""
    long = [r for r in rows if r.label is not None and len(r.label) > MAX_LABEL_CHARS]
    if long:
        raise DataError(
            f"{len(long)} row(s) have a label of more than {MAX_LABEL_CHARS} characters "
            f"({_places(long)}: {preview(long[0].label)}), a text rather than a category",
            hint="check data.fields.label names the label column, or fix the rows",
        )


def check_number_labels(read: RowsRead) -> list[str]:
    """A note when some labels are numbers and others words: in a CSV every value is text, so
    a `1` among `spam` and `ham` becomes a category of its own without a word."""
    if not read.has_label:
        return []
    numbers: dict[str, list[SourceRow]] = defaultdict(list)
    words = set()
    for row in read.rows:
        if row.label is None:
            continue
        if _is_number(row.label):
            numbers[row.label].append(row)
        else:
            words.add(row.label)
    if not numbers or not words:
        return []
    shown = "; ".join(f"{lab!r} ({len(rs)} row(s): {_places(rs)})" for lab, rs in numbers.items())
    return [
        f"label(s) written as numbers among {len(words)} text label(s): {shown}; each is a "
        "category of its own: fix the rows if they meant one of the text labels"
    ]


def _is_number(text: str) -> bool:
    try:
        float(text.strip())
    except ValueError:
        return False
    return bool(text.strip())


def labels_changed(rows: list[SourceRow]) -> int:
    """Rows whose label differs from the label as written (spaces aside): what unify_labels did."""
    return sum(
        1
        for r in rows
        if r.label is not None and r.label_raw is not None and r.label != str(r.label_raw).strip()
    )


def _variants_error(variants: dict[str, dict[str, list[SourceRow]]]) -> DataError:
    lines = []
    for spellings in list(variants.values())[:SHOWN_ROWS]:
        parts = [
            f"{s} ({len(rs)} row(s): {_places(rs)})" if rs else f"{s} (task.labels)"
            for s, rs in sorted(spellings.items(), key=lambda kv: -len(kv[1]))
        ]
        lines.append("  - " + " / ".join(parts))
    more = len(variants) - SHOWN_ROWS
    return DataError(
        f"{len(variants)} label(s) spelt in several ways (case, surrounding spaces, or a "
        "number in some rows and text in others, Unicode form, invisible characters), which "
        "would count as different "
        "categories or be merged without a word:\n"
        + "\n".join(lines)
        + (f"\n  ... and {more} more" if more > 0 else ""),
        hint="add `- rule: unify_labels` to data.cleaning (each label takes the spelling of "
        "task.labels, else its most frequent spelling; numbers become text), or fix the rows",
    )


# ---------------------------------------------------------------- control characters


def control_notes(texts: list[str], rows: list[SourceRow], what: str) -> list[str]:
    """A note when texts hold control characters or ANSI escapes: how many, where (first few).

    `texts[i]` belongs to `rows[i]`.
    """
    found = [(row, m) for text, row in zip(texts, rows, strict=True) if (m := CONTROL.search(text))]
    if not found:
        return []
    total = sum(len(CONTROL.findall(t)) for t in texts)
    examples = ", ".join(
        f"{row.where} character {m.start() + 1} ({preview(m.group())})"
        for row, m in found[:SHOWN_PLACES]
    )
    rule = (
        "; add `- rule: strip_control` to data.cleaning to remove them"
        if what == "text"
        else " (targets are never rewritten by cleaning: fix the data)"
    )
    return [
        f"{len(found)} {what}(s) hold {total} control character(s) or ANSI escape sequence(s), "
        f"e.g. {examples}{rule}"
    ]


# ---------------------------------------------------------------- gold targets


def _target_problem(target: str, task: Any, validator: Any, pattern: Any) -> str | None:
    if pattern is not None:
        from tunelab.lib.tasks.format import regex_mismatch

        return regex_mismatch(pattern, target.strip())
    try:
        value = loads_json(target)
    except ParseProblem as exc:
        return f"not valid JSON ({exc.problem})"
    if task.kind == "extraction" and not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    try:
        errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    except RecursionError:
        return "nested too deeply to check against task.json_schema"
    if not errors:
        return None
    err = errors[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
    schema_path = "/".join(str(p) for p in err.absolute_schema_path)
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"${where}: {preview(err.message, 120)} (schema: {schema_path}){more}"


def check_targets(read: RowsRead) -> list[str]:
    """Every gold target of a format or extraction task against the task's format.

    Raises DataError listing the offending rows (file, line, what fails and the schema path),
    unless data.invalid_targets is `keep`: then returns a note counting them.
    """
    rows, task, data = read.rows, read.config.task, read.config.data
    if task.kind not in ("format", "extraction") or data.fields.target is None:
        return []
    from tunelab.lib.tasks.format import answer_pattern, make_validator

    validator = make_validator(task.json_schema) if task.json_schema is not None else None
    pattern = answer_pattern(task.regex) if task.regex is not None else None
    bad = [
        (row, problem)
        for row in rows
        if row.target is not None
        and (problem := _target_problem(row.target, task, validator, pattern))
    ]
    if not bad:
        return []
    against = "task.regex" if pattern is not None else "task.json_schema"
    if len(bad) == len(rows):
        spec = f"`{task.regex}`" if pattern is not None else "the schema"
        raise DataError(
            f"none of the {len(rows)} gold target(s) satisfies {against} {spec}, e.g. "
            f"{bad[0][0].where}: {bad[0][1]}",
            hint=f"fix {against} in study.yaml (every answer would fail it), or check that "
            f"data.fields.target ({data.fields.target!r}) names the answer column",
        )
    empty = [row for row, _ in bad if not row.target.strip()]
    if empty and data.invalid_targets == "keep":
        raise DataError(
            f"{len(empty)} gold target(s) are empty, e.g. {empty[0].where} (field "
            f"{data.fields.target!r}): an empty answer can be neither trained on nor scored, "
            "so data.invalid_targets: keep does not keep it",
            hint="write the answer in those rows, or remove the rows, then run `tunelab data`",
        )
    if data.invalid_targets == "keep":
        return [
            f"{len(bad)} target(s) do not satisfy {against} (kept: data.invalid_targets is "
            f"keep), e.g. {bad[0][0].where}: {bad[0][1]}"
        ]
    lines = [f"  - {row.where}: {problem}" for row, problem in bad[:SHOWN_ROWS]]
    more = len(bad) - SHOWN_ROWS
    raise DataError(
        f"{len(bad)} gold target(s) do not satisfy {against} ({_article(task.kind)} task scores "
        "answers against them):\n"
        + "\n".join(lines)
        + (f"\n  ... and {more} more" if more > 0 else ""),
        hint=f"fix the targets in the data (data.fields.target: {data.fields.target!r}), or "
        "set data.invalid_targets: keep to keep them",
    )


def _article(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


SOURCE_CHECKS: list[Check] = [
    check_not_empty,
    check_label_spellings,
    check_number_labels,
    check_labels,
    check_targets,
]


def run_checks(read: RowsRead, checks: list[Check] | None = None) -> list[str]:
    """Run the checks (default `SOURCE_CHECKS`) in order; their notes, in that order (the first
    failing check raises)."""
    notes: list[str] = []
    for check in SOURCE_CHECKS if checks is None else checks:
        notes += check(read)
    return notes
