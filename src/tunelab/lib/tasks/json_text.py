"""Finding the JSON object in a model's free text: the one reader evaluation and inspect share.

Models wrap their answer: a ```json fence (closed, unclosed, or only a stray closing one), a
sentence before it, a remark after it. Fences are treated as prose, so every wrapping reads the
same. The answer is the first `{` whose braces close (outside JSON strings) on text that parses;
a candidate that closes but does not parse (e.g. `{the answer}`) is skipped along with the
braces inside it. A `{` that never closes is the end of the search: an answer cut by the
generation budget must not be replaced by an object nested inside it. An object that gives a
key twice (`{"a": 1, "a": 2}`) is the answer and `invalid_json`: which value counts is
undefined, so neither is taken (nor a later object).

Failure kinds (`FAILURE_KINDS`): `empty` (blank output), `no_json` (no object and no other JSON
value), `truncated` (an object that never closes), `invalid_json` (objects close but none
parses), `not_an_object` (the answer is a JSON array, number, string or literal).

`find_json_object(raw) -> FoundJson(value, failure, error, start, end)`; an object giving a key
twice is `invalid_json` with `end` set (`answer_complete(text)` is true there: generation stops).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tunelab.core.strict_load import DuplicateKey, no_duplicate_keys

FAILURE_KINDS = ("empty", "no_json", "truncated", "invalid_json", "not_an_object")
# a fence marker, with its language tag, at the start of the text
_LEADING_FENCE = re.compile(r"\A\s*```[A-Za-z0-9_+-]*[ \t]*")


@dataclass(frozen=True)
class FoundJson:
    """What `find_json_object` read: the value (None unless an object or another JSON value
    was read), the failure kind or None, a message, and where the value lies in the text."""

    value: Any
    failure: str | None
    error: str | None
    start: int | None = None
    end: int | None = None


def json_type(value: Any) -> str:
    """The JSON type of a decoded value: null, boolean, number, string, array or object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """json.loads without the NaN / Infinity extensions Python accepts, and refusing a key
    given twice in one object (DuplicateKey) rather than keeping its last value."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=no_duplicate_keys)


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the `}` closing the `{` at `start`, braces inside JSON strings ignored."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _leading_array(text: str) -> FoundJson | None:
    """A JSON array opening the answer (after any fence marker): the answer is not an object,
    even when the array holds objects."""
    fence = _LEADING_FENCE.match(text)
    at = fence.end() if fence else 0
    while at < len(text) and text[at].isspace():
        at += 1
    if not text.startswith("[", at):
        return None
    try:
        decoder = json.JSONDecoder(
            parse_constant=_reject_constant, object_pairs_hook=no_duplicate_keys
        )
        value, end = decoder.raw_decode(text, at)
    except DuplicateKey as exc:
        return FoundJson(None, "invalid_json", f"broken JSON: {exc.problem}", at)
    except (json.JSONDecodeError, ValueError):
        return None
    return FoundJson(value, "not_an_object", "expected a JSON object, found an array", at, end)


def _bare_value(text: str) -> FoundJson:
    """No object in the text: a lone JSON value (inside a fence or not) is `not_an_object`."""
    inner = _LEADING_FENCE.sub("", text).strip()
    inner = inner.removesuffix("```").strip()
    try:
        value = _loads(inner)
    except (json.JSONDecodeError, ValueError):
        return FoundJson(None, "no_json", "no JSON object found")
    return FoundJson(value, "not_an_object", f"expected a JSON object, found {json_type(value)}")


def find_json_object(raw: str | None) -> FoundJson:
    """The JSON object a model answered in `raw`, or the kind of failure (see the module)."""
    text = raw or ""
    if not text.strip():
        return FoundJson(None, "empty", "the output is empty")
    array = _leading_array(text)
    if array is not None:
        return array
    first_invalid: str | None = None
    at = text.find("{")
    while at >= 0:
        close = _closing_brace(text, at)
        if close is None:
            return FoundJson(
                None, "truncated", f"the JSON object opened at char {at} never closes", at
            )
        try:
            value = _loads(text[at : close + 1])
        except DuplicateKey as exc:  # the answer, ambiguous: no later object replaces it
            where = f"broken JSON: {exc.problem} (the object at char {at})"
            return FoundJson(None, "invalid_json", where, at, close + 1)
        except json.JSONDecodeError as exc:
            first_invalid = first_invalid or f"broken JSON: {exc.msg} at char {at + exc.pos}"
        except ValueError as exc:
            first_invalid = first_invalid or f"broken JSON: {exc}"
        else:
            return FoundJson(value, None, None, at, close + 1)
        at = text.find("{", close + 1)
    if first_invalid is not None:
        return FoundJson(None, "invalid_json", first_invalid)
    return _bare_value(text)


def answer_complete(text: str) -> bool:
    """Whether `find_json_object` already reads an object from `text` that no continuation of
    the text can change: the first object that closes and parses is found, and the text does not
    open with an array (which a continuation could still close around it).

    Generation stops there for a task whose answer is that object: what follows is never read.
    """
    fence = _LEADING_FENCE.match(text)
    opening = text[fence.end() if fence else 0 :].lstrip()
    if not opening or opening.startswith("["):
        return False
    found = find_json_object(text)
    return found.end is not None  # an object read, or one that gives a key twice
