"""Extraction: the answer is a JSON object whose required fields come from task.json_schema.

Parsing is forgiving about the wrapping and strict about the content: a ```json code fence and
text after the object are accepted; then the object must be JSON and satisfy the schema.
Failure kinds: `empty`, `parse_error` (no JSON object can be read), `not_an_object`,
`schema_error`. Every result lists each required field's value and presence.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tunelab.errors import DataError
from tunelab.tasks.base import Task, failure
from tunelab.tasks.format import make_validator, schema_errors, target_string

_FENCE = re.compile(r"```[a-zA-Z0-9_-]*[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)


def read_json_object(raw: str) -> tuple[Any, str | None]:
    """The first JSON value in `raw` (inside a code fence if there is one) and an error or None.

    Text before the first `{` and after the value is ignored.
    """
    text = raw.strip()
    fence = _FENCE.search(text)
    if fence:
        text = fence.group(1).strip()
    start = text.find("{")
    if start < 0:
        try:  # a bare non-object value ("42", "[1]") is JSON but not an object
            return json.loads(text), None
        except json.JSONDecodeError:
            return None, "no JSON object found"
    try:
        value, _ = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as exc:
        return None, f"broken JSON: {exc.msg} at char {exc.pos}"
    return value, None


def _present(value: Any) -> bool:
    return value is not None and value != "" and value != [] and value != {}


def _normalize(value: Any) -> Any:
    if isinstance(value, str):
        return " ".join(value.split())
    return value


class ExtractionTask(Task):
    kind = "extraction"
    metric_names = (
        "json_valid_rate",
        "schema_valid_rate",
        "field_presence_rate",
        "field_accuracy",
        "field_micro_f1",
        "exact_match",
    )

    def __init__(self, instruction: str, json_schema: dict[str, Any]):
        super().__init__(None, instruction)
        self.json_schema = json_schema
        self.validator = make_validator(json_schema)
        self.fields: list[str] = list(json_schema.get("required") or [])

    def target_text(self, example: dict[str, Any]) -> str:
        return target_string(example)

    def parse(self, raw_output: str) -> dict[str, Any]:
        empty_fields = {f: None for f in self.fields}
        no_presence = {f: False for f in self.fields}
        extra = {"json_valid": False, "schema_valid": False}
        if not (raw_output or "").strip():
            return failure(
                "empty", "the output is empty", fields=empty_fields, present=no_presence, **extra
            )
        value, error = read_json_object(raw_output)
        if error is not None:
            return failure("parse_error", error, fields=empty_fields, present=no_presence, **extra)
        if not isinstance(value, dict):
            return failure(
                "not_an_object",
                f"expected a JSON object, found {type(value).__name__}",
                fields=empty_fields,
                present=no_presence,
                json_valid=True,
                schema_valid=False,
            )
        fields = {f: value.get(f) for f in self.fields}
        present = {f: f in value and _present(value[f]) for f in self.fields}
        errors = schema_errors(self.validator, value)
        return {
            "valid": not errors,
            "failure": "schema_error" if errors else None,
            "error": "; ".join(errors) if errors else None,
            "value": value,
            "json_valid": True,
            "schema_valid": not errors,
            "fields": fields,
            "present": present,
        }

    def gold(self, example: dict[str, Any]) -> dict[str, Any]:
        parsed = self.parse(self.target_text(example))
        if parsed["failure"] in ("empty", "parse_error", "not_an_object"):
            raise DataError(
                f"example {example.get('id')!r}: the target is not a JSON object "
                f"({parsed['error']})",
                hint="fix the example's target column; it must be a JSON object string",
            )
        return parsed["value"]

    def verdicts(self, parsed: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
        gold = self.gold(example)
        fields = parsed.get("fields") or {}
        correct = {
            f: bool(parsed.get("present", {}).get(f))
            and _normalize(fields.get(f)) == _normalize(gold.get(f))
            for f in self.fields
        }
        return {
            "json_valid": bool(parsed.get("json_valid")),
            "schema_valid": bool(parsed.get("schema_valid")),
            "present": dict(parsed.get("present") or {}),
            "field_correct": correct,
            "exact_match": all(correct.values()),
            "correct": all(correct.values()),
        }
