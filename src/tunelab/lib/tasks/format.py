"""Format: the answer must respect a format given as a JSON Schema or a regular expression.

Validity is strict: the whole answer (surrounding whitespace aside) must be the JSON value, or
must match the regular expression in full. Failure kinds: `empty`, `parse_error` (not JSON),
`schema_error` (JSON that breaks the schema), `no_match` (the regex does not match).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import validators

from tunelab.core.config_sections import json_schema_problem, regex_problem
from tunelab.core.errors import ConfigError, DataError, preview
from tunelab.core.strict_load import ParseProblem, loads_json
from tunelab.lib.tasks.base import Task, failure


def make_validator(schema: dict[str, Any]):
    """A jsonschema validator for `schema` (its draft from `$schema`, else the latest)."""
    problem = json_schema_problem(schema)
    if problem:
        raise ConfigError(f"task.json_schema: {problem}", hint="fix task.json_schema in study.yaml")
    return validators.validator_for(schema)(schema)


def schema_errors(validator, value: Any) -> list[str]:
    """Messages of every schema violation, each prefixed by its JSON path."""
    out = []
    for err in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        out.append(f"{where}: {err.message}")
    return out


def answer_pattern(regex: str) -> re.Pattern[str]:
    """task.regex compiled as Python reads it: `.` stops at a newline, so `Subject: .+` keeps a
    one-line answer one line (`(?s)` in the regex lets `.` span lines)."""
    return re.compile(regex)


def regex_mismatch(pattern: re.Pattern[str], text: str) -> str | None:
    """Why `text` (already stripped) does not match `pattern` in full, or None when it does."""
    if pattern.fullmatch(text) is not None:
        return None
    if not text:
        return "empty"
    lines = text.splitlines()
    if len(lines) > 1 and pattern.fullmatch(lines[0].strip()) is not None:
        return f"the first line matches task.regex, then {len(lines) - 1} more line(s) follow"
    head = pattern.match(text)
    if head is not None and head.end() > 0:
        return (
            f"matches task.regex up to character {head.end()} of {len(text)}; "
            f"the rest does not ({preview(text[head.end() :], 40)})"
        )
    found = pattern.search(text)
    if found is not None and found.end() > found.start():
        return (
            f"holds a match of task.regex at character {found.start() + 1}, "
            "but the whole answer must match"
        )
    return f"does not match task.regex (starts {preview(text, 40)})"


def same_json(a: Any, b: Any) -> bool:
    """JSON values equal as JSON means them: numbers by value (`1` = `1.0`), but `true` is no
    `1` (Python's `True == 1` would count a wrong answer right), objects key by key, arrays in
    order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return False
    return a == b


def target_string(example: dict[str, Any]) -> str:
    target = example.get("target")
    if isinstance(target, (dict, list)):
        return json.dumps(target, ensure_ascii=False)
    if not isinstance(target, str) or not target:
        raise DataError(
            f"example {example.get('id')!r}: no target answer (found {target!r})",
            hint="set data.fields.target in study.yaml to the column holding the expected "
            "answer, then rebuild the snapshot with `tunelab data`",
        )
    return target


class FormatTask(Task):
    kind = "format"

    def __init__(self, instruction: str, json_schema: dict[str, Any] | None, regex: str | None):
        super().__init__(None, instruction)
        self.json_schema = json_schema
        self.regex = regex
        self.validator = make_validator(json_schema) if json_schema is not None else None
        self.pattern = None
        if regex is not None:
            problem = regex_problem(regex)
            if problem:
                raise ConfigError(f"task.regex: {problem}", hint="fix task.regex in study.yaml")
            self.pattern = answer_pattern(regex)
        base = ("format_valid_rate", "exact_match")
        self.metric_names = base + (("json_valid_rate",) if json_schema is not None else ())

    def target_text(self, example: dict[str, Any]) -> str:
        return target_string(example)

    def parse(self, raw_output: str) -> dict[str, Any]:
        text = (raw_output or "").strip()
        if not text:
            return failure("empty", "the output is empty", json_valid=False)
        if self.pattern is not None:
            mismatch = regex_mismatch(self.pattern, text)
            if mismatch is not None:
                return failure("no_match", mismatch, json_valid=None)
            return {
                "valid": True,
                "failure": None,
                "error": None,
                "value": text,
                "json_valid": None,
            }
        try:
            value = loads_json(text)  # as strict as the gold check: no NaN, no key twice
        except ParseProblem as exc:
            where = f" at {exc.place()}" if exc.place() else ""
            return failure("parse_error", f"not JSON: {exc.problem}{where}", json_valid=False)
        errors = schema_errors(self.validator, value)
        if errors:
            return {
                "valid": False,
                "failure": "schema_error",
                "error": "; ".join(errors),
                "value": value,
                "json_valid": True,
            }
        return {"valid": True, "failure": None, "error": None, "value": value, "json_valid": True}

    def verdicts(self, parsed: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
        gold_text = self.target_text(example)
        if self.pattern is None:
            try:
                gold: Any = loads_json(gold_text)
            except ParseProblem:
                gold = gold_text
        else:
            gold = gold_text.strip()
        exact = parsed.get("failure") != "parse_error" and same_json(parsed.get("value"), gold)
        return {
            "valid": bool(parsed.get("valid")),
            "json_valid": parsed.get("json_valid"),
            "exact_match": bool(exact),
            "correct": bool(parsed.get("valid") and exact),
        }
