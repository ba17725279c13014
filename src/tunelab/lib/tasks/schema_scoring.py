"""Scoring an extraction answer against its gold object, path by path, as the JSON Schema says.

Paths: a top-level field is its name (`sender`); a field of a nested object `address.city`; a
list is scored at its own path (`quantities`) and the fields of its items at `quantities[].unit`
(a list of lists: `matrix[]`). An object's scored fields are its `required` list, else its
`properties`; a path is judged only where the gold value has the key.

Rules for one value (gold g, answer a):
- different JSON types never match (`"2"` against 2, `null` against `[]`): `wrong_type`;
- numbers compare numerically (2 matches 2.0), within `tolerance[path]` when one is set;
  strings by `normalize_text`; booleans and null exactly;
- objects match when every scored field matches; an object schema naming no fields (a map,
  e.g. `additionalProperties` only) compares every key, and a key the gold lacks is wrong;
- lists are multisets: gold and answer items are paired one to one (`alignment.align`) to
  maximize first the number of items that match whole, then the number of agreeing fields; a
  list matches when every gold item is paired with a whole match and no answer item is left
  over. A list path named in `ordered` pairs items by position instead, and so does a tuple
  (`prefixItems`, or `items` given as a list): its positions mean different things.
Each judged place (a slot) gets one verdict: a match, or a failure kind: `missing` (the key is
absent), `wrong_type`, `wrong_value` (same type, other value) or `not_json` (the output held no
JSON object). Fields inside a missing or mistyped object inherit its failure kind.

Per path and example, `score` counts (all ints): `slots`, `present` (answer value not null,
blank, [] or {}), `empty_match` (the gold is null, blank, [] or {} and the answer matches it:
the field is answered, though not present; presence rates count both), `exact` (equal JSON, lists in order), `match`, the failure kinds, and `tp`,
`pred`, `gold` for precision and recall: for a list path they count items (a true positive is a
gold item paired with an answer item that matches it whole); elsewhere present values (a true
positive is a present answer value matching a present gold value). Sub-fields of list items are
judged on the paired items only: each pair is one slot of `quantities[].unit`.

Pure: values in, values out.

`SchemaScorer(schema, ordered=, tolerance=)`: `.paths` {path: PathSpec(path, kind value |
object | list | list_of_objects, node, nullable)}, `.score(gold, answer, failure=None) -> {path:
{slots, present, empty_match, exact, match, tp, pred, gold, missing, wrong_type, wrong_value,
not_json}}` (zero counts left out), `.tuples` (list paths scored by position),
`.target_kinds(gold)`; `SCORING_VERSION` names the rules in every record scored by them.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tunelab.core.errors import ConfigError
from tunelab.lib.tasks.alignment import align
from tunelab.lib.tasks.json_text import json_type

SCORING_VERSION = "tunelab-extraction/3"
SLOT_FAILURES = ("missing", "wrong_type", "wrong_value", "not_json")
COUNT_KEYS = (
    "slots",
    "present",
    "empty_match",
    "exact",
    "match",
    "tp",
    "pred",
    "gold",
    *SLOT_FAILURES,
)
LIST_KINDS = ("list", "list_of_objects")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def normalize_text(text: str) -> str:
    """The comparable form of a string: NFKC, case-folded, whitespace collapsed, surrounding
    quotes and angle brackets and trailing punctuation removed (`"<Bob@X.org>"` -> `bob@x.org`)."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.strip(" \"'`<>").rstrip(".,;:")


def is_present(value: Any) -> bool:
    """A value counts as present unless it is missing, null, a blank string, [] or {}."""
    if value is None or value is MISSING:
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list | dict):
        return bool(value)
    return True


def json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON: same types (true is not 1), numbers by value, lists in order."""
    ta = json_type(a)
    if ta != json_type(b):
        return False
    if ta == "array":
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if ta == "object":
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return a == b


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---------------------------------------------------------------- the schema's paths


def _types(node: Mapping[str, Any]) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "properties" in node or "required" in node:
        return {"object"}
    if "items" in node:
        return {"array"}
    return set()


@dataclass(frozen=True)
class PathSpec:
    """One scored path: `kind` is value, object, list or list_of_objects; `node` its schema."""

    path: str
    kind: str
    node: Mapping[str, Any]
    nullable: bool


class SchemaScorer:
    """The paths of `schema` and the rules above, with the opt-in `ordered` list paths and
    per-path numeric `tolerance`. Raises ConfigError for an option naming no such path."""

    def __init__(
        self,
        schema: Mapping[str, Any],
        *,
        ordered: Iterable[str] = (),
        tolerance: Mapping[str, float] | None = None,
    ):
        self.root = schema
        self.fields: list[str] = [str(f) for f in schema.get("required") or []]
        self.paths: dict[str, PathSpec] = {}
        self.tuples: set[str] = set()  # list paths whose schema gives each position its own
        for key in self.fields:
            self._walk(self.child(schema, key), key, depth=0)
        self.ordered = frozenset(ordered)
        self.tolerance = dict(tolerance or {})
        self._check_options()

    # -- schema navigation

    def resolve(self, node: Any, depth: int = 0) -> Mapping[str, Any]:
        """`node` with local `$ref`s followed and, for anyOf / oneOf, its object or array
        alternative (a nullable object or list keeps its structure)."""
        if not isinstance(node, Mapping):
            return {}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and depth < 32:
            target: Any = self.root
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                target = target.get(part) if isinstance(target, Mapping) else None
            return self.resolve(target, depth + 1)
        for key in ("anyOf", "oneOf"):
            alternatives = node.get(key)
            if isinstance(alternatives, list):
                for alt in alternatives:
                    resolved = self.resolve(alt, depth + 1)
                    if _types(resolved) & {"object", "array"}:
                        return resolved
        return node

    def _nullable(self, node: Any) -> bool:
        """Whether the schema names null among the node's types (an untyped node does not)."""
        if not isinstance(node, Mapping):
            return False
        if "null" in _types(node):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str):
            return "null" in _types(self.resolve(node))
        for key in ("anyOf", "oneOf"):
            alternatives = node.get(key)
            if isinstance(alternatives, list) and any(
                "null" in _types(self.resolve(a)) for a in alternatives
            ):
                return True
        return False

    def child(self, node: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        props = self.resolve(node).get("properties")
        return props.get(key, {}) if isinstance(props, Mapping) else {}

    def items(self, node: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.resolve(self.resolve(node).get("items"))

    def keys(self, node: Mapping[str, Any], gold: Mapping[str, Any]) -> list[str]:
        """The fields of `node` judged on `gold`: required, else properties, that gold has; an
        object schema naming none compares every key of gold."""
        named = _named(self.resolve(node))
        return list(gold) if named is None else [k for k in named if k in gold]

    def kind(self, node: Mapping[str, Any]) -> str:
        node = self.resolve(node)
        types = _types(node)
        if "array" in types:
            item = self.items(node)
            named = item.get("properties") or item.get("required")
            return "list_of_objects" if "object" in _types(item) and named else "list"
        if "object" in types and (node.get("properties") or node.get("required")):
            return "object"
        return "value"

    def _walk(self, raw: Mapping[str, Any], path: str, depth: int) -> None:
        node = self.resolve(raw)
        kind = self.kind(node)
        self.paths[path] = PathSpec(path, kind, node, self._nullable(raw))
        if depth > 16:  # a recursive schema: deeper values compare whole
            return
        if kind == "object":
            for key in _named(node) or []:
                self._walk(self.child(node, key), join_path(path, key), depth + 1)
        elif kind in LIST_KINDS:
            if "prefixItems" in node or isinstance(node.get("items"), list):
                self.tuples.add(path)
            item = self.items(node)
            if kind == "list_of_objects":
                for key in _named(item) or []:
                    self._walk(self.child(item, key), f"{path}[].{key}", depth + 1)
            elif "array" in _types(item):
                self._walk(item, f"{path}[]", depth + 1)

    def _check_options(self) -> None:
        problems = []
        lists = [p for p, s in self.paths.items() if s.kind in LIST_KINDS]
        for path in sorted(self.ordered):
            if path not in lists:
                problems.append(f"task.scoring.ordered names {path!r}, not a list path")
        for path, tol in sorted(self.tolerance.items()):
            spec = self.paths.get(path)
            if spec is None or spec.kind not in ("value", "list"):
                types = {"object"}
            else:
                types = _types(self.items(spec.node) if spec.kind == "list" else spec.node)
            if types and not types & {"number", "integer"}:
                problems.append(f"task.scoring.tolerance names {path!r}, not a number path")
            elif not tol >= 0:
                problems.append(f"task.scoring.tolerance[{path!r}] is {tol}, expected >= 0")
        if problems:
            raise ConfigError(
                "; ".join(problems),
                hint="the schema's paths: "
                + ", ".join(f"{p} ({s.kind})" for p, s in self.paths.items())
                + " (a list of numbers takes its tolerance at the list's path)",
            )

    # -- comparing values

    def _tol(self, path: str) -> float:
        if path in self.tolerance:
            return self.tolerance[path]
        return self.tolerance.get(path.removesuffix("[]"), 0.0)

    def same(self, node: Mapping[str, Any], path: str, gold: Any, answer: Any) -> bool:
        """Whether `answer` matches `gold` at `path` under the module's rules."""
        kind = json_type(gold)
        if kind != json_type(answer):
            return False
        if kind == "number":
            return abs(gold - answer) <= self._tol(path)
        if kind == "string":
            return normalize_text(gold) == normalize_text(answer)
        if kind == "array":
            pairs = self.pair_items(node, path, gold, answer)
            return len(gold) == len(answer) == sum(full for _, _, full in pairs)
        if kind == "object":
            if _named(self.resolve(node)) is None and set(answer) - set(gold):
                return False  # a map's keys are its data: an invented entry is wrong
            return all(
                k in answer
                and self.same(self.child(node, k), join_path(path, k), gold[k], answer[k])
                for k in self.keys(node, gold)
            )
        return gold == answer

    def pair_items(
        self, node: Mapping[str, Any], path: str, gold: list[Any], answer: list[Any]
    ) -> list[tuple[int, int, bool]]:
        """(gold index, answer index, matches whole) for each paired item of the list at
        `path`: by position for an ordered path or a tuple, else by `align` on (whole matches,
        agreeing fields)."""
        item, item_path = self.items(node), f"{path}[]"
        if path in self.ordered or path in self.tuples:
            return [
                (i, i, self.same(item, item_path, gold[i], answer[i]))
                for i in range(min(len(gold), len(answer)))
            ]
        full = [[self.same(item, item_path, g, a) for a in answer] for g in gold]
        agree = [[int(f) for f in row] for row in full]
        for i, g in enumerate(gold):
            if isinstance(g, dict):
                keys = self.keys(item, g)
                for j, a in enumerate(answer):
                    if isinstance(a, dict):
                        agree[i][j] = sum(
                            k in a
                            and self.same(self.child(item, k), join_path(item_path, k), g[k], a[k])
                            for k in keys
                        )
        widest = max((x for row in agree for x in row), default=0)
        whole = min(len(gold), len(answer)) * widest + 1  # one more whole match outweighs any
        weights = [
            [whole * f + a for f, a in zip(fr, ar, strict=True)]
            for fr, ar in zip(full, agree, strict=True)
        ]
        return [(i, j, full[i][j]) for i, j in align(weights)]

    # -- counting

    def score(
        self, gold: Mapping[str, Any], answer: Any, failure: str | None = None
    ) -> dict[str, dict[str, int]]:
        """Counts per path (see the module) of one example. `answer` is the parsed object;
        `failure` is None for an object, "not_json" when no JSON was read, "wrong_type" for
        JSON that is not an object. Counts of zero are left out; so are paths with no slot."""
        out: dict[str, Counter[str]] = {}
        for key in self.fields:
            if key in gold:
                value = answer.get(key, MISSING) if failure is None else MISSING
                self._slot(self.child(self.root, key), key, gold[key], value, failure, out)
        return {p: {k: c[k] for k in COUNT_KEYS if c[k]} for p, c in out.items() if c["slots"]}

    def _slot(
        self,
        node: Mapping[str, Any],
        path: str,
        gold: Any,
        answer: Any,
        inherited: str | None,
        out: dict[str, Counter[str]],
    ) -> bool:
        """Judge one slot at `path` (and the slots below it), add its counts to `out`, and
        say whether it matches."""
        c = out.setdefault(path, Counter())
        c["slots"] += 1
        given = answer is not MISSING
        present = is_present(answer)
        c["present"] += present
        c["exact"] += given and json_equal(gold, answer)
        spec = self.paths.get(path)
        gold_type = json_type(gold)
        as_list = gold_type == "array" or (spec is not None and spec.kind in LIST_KINDS)
        failure = inherited or (
            "missing" if not given else "wrong_type" if gold_type != json_type(answer) else None
        )
        tp = 0
        if failure is None and gold_type == "array":
            pairs = self.pair_items(node, path, gold, answer)
            tp = sum(full for _, _, full in pairs)
            matched = len(gold) == len(answer) == tp
            item = self.items(node)
            for i, j, _ in pairs:
                self._item_slots(item, f"{path}[]", gold[i], answer[j], out)
        elif gold_type == "object" and spec is not None and spec.kind == "object":
            results = [
                self._slot(
                    self.child(node, k),
                    join_path(path, k),
                    gold[k],
                    answer.get(k, MISSING) if failure is None else MISSING,
                    failure,
                    out,
                )
                for k in self.keys(node, gold)
            ]
            matched = failure is None and all(results)
        else:
            matched = failure is None and self.same(node, path, gold, answer)
        if failure is None and not matched:
            failure = "wrong_value"
        if failure:
            c[failure] += 1
        c["match"] += matched
        c["empty_match"] += matched and not is_present(gold)
        if as_list:
            c["gold"] += len(gold) if gold_type == "array" else 0
            c["pred"] += len(answer) if given and isinstance(answer, list) else 0
            c["tp"] += tp
        else:
            c["gold"] += is_present(gold)
            c["pred"] += present
            c["tp"] += present and is_present(gold) and matched
        return matched

    def _item_slots(
        self, item: Mapping[str, Any], path: str, gold: Any, answer: Any, out: dict
    ) -> None:
        """The slots inside one paired list item: its fields, or the inner list's path."""
        kind = self.kind(item)
        if kind == "object" and isinstance(gold, dict):
            failure = None if isinstance(answer, dict) else "wrong_type"
            for k in self.keys(item, gold):
                value = answer.get(k, MISSING) if failure is None else MISSING
                self._slot(self.child(item, k), f"{path}.{k}", gold[k], value, failure, out)
        elif kind in LIST_KINDS and isinstance(gold, list):
            self._slot(item, path, gold, answer, None, out)

    # -- target kinds

    def target_kinds(self, gold: Mapping[str, Any]) -> list[str]:
        """The kinds of gold value that scoring treats apart, one per list or nullable path
        outside lists: `PATH empty`, `PATH null` or `PATH filled`, in the schema's order."""
        out = []
        for path, spec in self.paths.items():
            if "[]" in path or not (spec.kind in LIST_KINDS or spec.nullable):
                continue
            value: Any = gold
            for part in path.split("."):
                value = value.get(part, MISSING) if isinstance(value, dict) else MISSING
            if value is MISSING:
                continue
            tag = "null" if value is None else "empty" if value == [] else "filled"
            out.append(f"{path} {tag}")
        return out


def _named(node: Mapping[str, Any]) -> list[str] | None:
    """An object schema's scored fields: `required`, else `properties`; None when it names none."""
    named = node.get("required")
    if isinstance(named, list):
        return [str(k) for k in named]
    props = node.get("properties")
    return list(props) if isinstance(props, Mapping) else None
