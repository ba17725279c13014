"""Extraction: the answer is a JSON object whose fields come from task.json_schema.

Parsing is forgiving about the wrapping and strict about the content: the object is read from
free text by `json_text.find_json_object` (fences, prose before or after), then must satisfy
the schema. A gold target is read strictly (`strict_load.loads_json`, as `tunelab data` checks
it): the whole target is one JSON object, a key given twice is refused, not last-wins. Failure kinds of `parse`: `empty`, `parse_error` (no JSON object can be read; the
reader's own kind is in `json_failure`), `not_an_object`, `schema_error`. Scoring follows the
schema path by path (`schema_scoring.SchemaScorer`), with `task.scoring` options.

`read_gold(text) -> (object, None) | (None, problem)`; `ExtractionTask.gold(example)` raises
DataError, `check_golds(examples)` runs it over an evaluation's rows before any generation.
`target_kinds(example)` gives `PATH empty|null|filled` (the snapshot manifest counts them as
`counts.target_kinds` {split: {kind: n}}); `target_problems` reports `target_not_json` and
`target_schema_error`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tunelab.core.errors import DataError
from tunelab.core.strict_load import ParseProblem, loads_json
from tunelab.lib.tasks.base import Task, failure
from tunelab.lib.tasks.format import make_validator, schema_errors, target_string
from tunelab.lib.tasks.json_text import find_json_object, json_type
from tunelab.lib.tasks.schema_scoring import SchemaScorer, is_present

# inspect's categories besides the target kinds: apart from its overall "all" row
NO_KINDS = "(no list or nullable field)"
NOT_JSON = "(target not a JSON object)"


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

    def __init__(
        self,
        instruction: str,
        json_schema: dict[str, Any],
        *,
        ordered: Iterable[str] = (),
        tolerance: Mapping[str, float] | None = None,
    ):
        super().__init__(None, instruction)
        self.json_schema = json_schema
        self.validator = make_validator(json_schema)
        self.scorer = SchemaScorer(json_schema, ordered=ordered, tolerance=tolerance)
        self.fields: list[str] = list(self.scorer.fields)
        # every scored path, top-level fields first as the schema lists them
        self.paths: list[dict[str, str]] = [
            {"path": p, "kind": s.kind} for p, s in self.scorer.paths.items()
        ]

    def target_text(self, example: dict[str, Any]) -> str:
        return target_string(example)

    def parse(self, raw_output: str) -> dict[str, Any]:
        empty_fields = {f: None for f in self.fields}
        no_presence = {f: False for f in self.fields}
        found = find_json_object(raw_output)
        extra = {"fields": empty_fields, "present": no_presence, "json_failure": found.failure}
        if found.failure == "empty":
            return failure(
                "empty", found.error or "", json_valid=False, schema_valid=False, **extra
            )
        if found.failure == "not_an_object":
            out = failure(
                "not_an_object", found.error or "", json_valid=True, schema_valid=False, **extra
            )
            return {**out, "value": found.value}
        if found.failure is not None:
            return failure(
                "parse_error", found.error or "", json_valid=False, schema_valid=False, **extra
            )
        value = found.value
        errors = schema_errors(self.validator, value)
        return {
            "valid": not errors,
            "failure": "schema_error" if errors else None,
            "error": "; ".join(errors) if errors else None,
            "value": value,
            "json_valid": True,
            "schema_valid": not errors,
            "json_failure": None,
            "fields": {f: value.get(f) for f in self.fields},
            "present": {f: is_present(value.get(f)) for f in self.fields},
        }

    def gold(self, example: dict[str, Any]) -> dict[str, Any]:
        """The example's gold object. Raises DataError when the target is not exactly one JSON
        object (a key given twice included): no answer could be scored against it."""
        value, problem = read_gold(self.target_text(example))
        if problem is not None:
            raise DataError(
                f"example {example.get('id')!r}: the target is not a JSON object ({problem})",
                hint="fix the target in the data (or drop the row), then rebuild the snapshot "
                "with `tunelab data`; data.invalid_targets: keep lets such targets in",
            )
        return value

    def check_golds(self, examples: Sequence[dict[str, Any]]) -> None:
        """Raise `gold`'s DataError for the first example whose target cannot be scored: an
        evaluation checks every gold before it generates any answer."""
        for example in examples:
            self.gold(example)

    def verdicts(self, parsed: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
        """Per-example verdicts: the parse outcome, the counts of every path (`paths`, see
        schema_scoring), and whether every top-level field matches (`correct`) or is exactly
        the gold value (`exact_match`)."""
        gold = self.gold(example)
        value = parsed.get("value")
        if isinstance(value, dict):
            paths = self.scorer.score(gold, value)
        else:
            kind = "wrong_type" if parsed.get("json_valid") else "not_json"
            paths = self.scorer.score(gold, None, kind)
        judged = [paths[f] for f in self.fields if f in paths]
        correct = all(c.get("match") for c in judged)
        return {
            "json_valid": bool(parsed.get("json_valid")),
            "schema_valid": bool(parsed.get("schema_valid")),
            "failure": parsed.get("failure"),
            "json_failure": parsed.get("json_failure"),
            "paths": paths,
            "exact_match": all(c.get("exact") for c in judged),
            "all_fields_match": correct,
            "correct": correct,
        }

    # -- what the data and inspect ask of the targets

    def target_kinds(self, example: dict[str, Any]) -> list[str]:
        """The target's kinds that scoring treats apart (`SchemaScorer.target_kinds`); none
        for a target that is not a JSON object (evaluation refuses it, inspect reports it)."""
        try:
            value, problem = read_gold(self.target_text(example))
        except DataError:
            return []
        return [] if problem is not None else self.scorer.target_kinds(value)

    def categories(self, rows: Sequence[dict[str, Any]]) -> list[str] | None:
        """Inspect's category of each unlabelled row: its target kinds, e.g. `list null`, else
        NO_KINDS, or NOT_JSON for a target no answer can be scored against (None for labelled
        rows or when every row is NO_KINDS)."""
        if any(r.get("label") is not None for r in rows):
            return None
        out = [self._category(r) for r in rows]
        return None if all(c == NO_KINDS for c in out) else out

    def _category(self, row: dict[str, Any]) -> str:
        try:
            value, problem = read_gold(self.target_text(row))
        except DataError:
            return NOT_JSON
        if problem is not None:
            return NOT_JSON
        return ", ".join(self.scorer.target_kinds(value)) or NO_KINDS

    def target_problems(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        """Targets that can never be matched: not read as a JSON object by the answers' reader,
        or against the schema. Each: {example_id, kind, message, fix}."""
        out = []
        for r in rows:
            where = str(r.get("id"))
            value, problem = read_gold(target_string(r))
            if problem is not None:
                out.append(
                    {
                        "example_id": where,
                        "kind": "target_not_json",
                        "message": f"the target is not a JSON object ({problem})",
                        "fix": "make the target column a JSON object string, then rebuild "
                        "the snapshot with `tunelab data`",
                    }
                )
                continue
            errors = schema_errors(self.validator, value)
            if errors:
                out.append(
                    {
                        "example_id": where,
                        "kind": "target_schema_error",
                        "message": "the target breaks task.json_schema: " + "; ".join(errors),
                        "fix": "fix the target, or let task.json_schema allow it (e.g. "
                        "type: [string, 'null'] for a field that may be null)",
                    }
                )
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "paths": self.paths}


def read_gold(target: str) -> tuple[dict[str, Any], None] | tuple[None, str]:
    """(the gold object, None) or (None, what is wrong): the target must be one JSON object,
    read strictly (no prose or fence around it, no key given twice, no NaN)."""
    try:
        value = loads_json(target)
    except ParseProblem as exc:
        place = exc.place()
        return None, f"{exc.problem}" + (f" at {place}" if place else "")
    if not isinstance(value, dict):
        return None, f"a JSON {json_type(value)}, not an object"
    return value, None
