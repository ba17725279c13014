"""YAML and JSON read strictly and within bounds: what a user hands tunelab is parsed here.

- A key given twice in one mapping (YAML) or one object (JSON) is refused, not last-wins.
- YAML aliases may not expand the document beyond `MAX_YAML_VALUES` values (an anchor/alias
  "billion laughs" document is refused while it is composed, before anything walks it), nor
  refer to themselves; nesting deeper than `MAX_DEPTH` is refused in both formats.
- Floats in YAML follow YAML 1.2 (`2e-4` is a number, as every user expects, not a string).

Problems raise `ParseProblem` (what, line, column); callers add the file and the hint and raise
their own TunelabError kind.

`load_yaml(text)` and `loads_json(text)` raise `ParseProblem(problem, line, column)`; a key given
twice raises its subclass `DuplicateKey`. `no_duplicate_keys(pairs)` is the `json.loads`
object_pairs_hook that refuses it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

MAX_DEPTH = 100  # nesting levels of one value (a study.yaml uses < 10; a JSON row < 20)
MAX_YAML_VALUES = 100_000  # values of a YAML document once its aliases are expanded


class ParseProblem(ValueError):
    """A located parse problem: `problem` says what, `line`/`column` (1-based) where."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None):
        super().__init__(problem)
        self.problem = problem
        self.line = line
        self.column = column

    def place(self) -> str:
        """'line 3, column 7' (or '' when unknown)."""
        if self.line is None:
            return ""
        return f"line {self.line}" + (f", column {self.column}" if self.column else "")


# ---------------------------------------------------------------- YAML


def _mark(node_or_event: Any) -> tuple[int | None, int | None]:
    mark = getattr(node_or_event, "start_mark", None)
    return (mark.line + 1, mark.column + 1) if mark is not None else (None, None)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, counts alias expansion and bounds nesting."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._values = 0  # values of the document as if its aliases were expanded
        self._depth = 0
        self._open: set[str] = set()  # anchors whose node is being composed
        self._sizes: dict[int, int] = {}  # expanded size of each finished node, by id

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self._open:
                raise ParseProblem(f"alias *{event.anchor} refers to itself", *_mark(event))
            node = super().compose_node(parent, index)
            self._count(self._size(node), event, f"alias *{event.anchor}")
            return node
        event = self.peek_event()
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ParseProblem(f"nested more than {MAX_DEPTH} levels deep", *_mark(event))
        if event.anchor is not None:
            self._open.add(event.anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.discard(event.anchor)
        self._count(1, event, "this value")
        return node

    def _count(self, n: int, event: Any, what: str) -> None:
        self._values += n
        if self._values > MAX_YAML_VALUES:
            raise ParseProblem(
                f"{what} expands the document beyond {MAX_YAML_VALUES:,} values "
                "(anchors and aliases that multiply)",
                *_mark(event),
            )

    def _size(self, node: Any) -> int:
        """Values in `node` with every alias inside it expanded (memoized: a DAG, no cycle)."""
        key = id(node)
        if key not in self._sizes:
            if isinstance(node, yaml.SequenceNode):
                size = 1 + sum(self._size(n) for n in node.value)
            elif isinstance(node, yaml.MappingNode):
                size = 1 + sum(self._size(k) + self._size(v) for k, v in node.value)
            else:
                size = 1
            self._sizes[key] = size
        return self._sizes[key]

    def construct_yaml_int(self, node: Any) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError as exc:  # more digits than Python converts
            raise ParseProblem(f"a number cannot be read ({str(exc)[:70]})", *_mark(node)) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int | None] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key, -1)
                except TypeError:  # an unhashable key: SafeConstructor names it below
                    continue
                line, column = _mark(key_node)
                if first != -1:
                    raise ParseProblem(
                        f"key {preview_key(key)} given twice in one mapping"
                        + (f" (first at line {first})" if first else ""),
                        line,
                        column,
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
# YAML 1.2 floats: 1e-4, 2E5, -3e+2 (YAML 1.1, PyYAML's default, reads them as strings)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def preview_key(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


def load_yaml(text: str) -> Any:
    """Parse one YAML document strictly. Raises ParseProblem (located) on any problem."""
    loader = None
    try:
        loader = _StrictLoader(text)  # its reader refuses unprintable characters at once
        return loader.get_single_data()
    except ParseProblem:
        raise
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        what = f"character {exc.character!r}" if isinstance(exc.character, str) else "a byte"
        raise ParseProblem(
            f"not valid YAML: {what} is not allowed ({exc.reason})", line, column
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "not valid YAML"
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        raise ParseProblem(f"not valid YAML: {problem}", line, column) from None
    except yaml.YAMLError as exc:
        raise ParseProblem(f"not valid YAML: {str(exc)[:200]}") from None
    except RecursionError:
        raise ParseProblem(f"nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ParseProblem(f"a value cannot be read: {str(exc)[:120]}") from None
    finally:
        if loader is not None:
            loader.dispose()


# ---------------------------------------------------------------- JSON

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


class DuplicateKey(ParseProblem):
    """A key given twice in one JSON object (which of its values counts is undefined)."""


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads` object_pairs_hook: the object, or DuplicateKey for a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"key {preview_key(key)} given twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ParseProblem(f"{name} is not a JSON value (write null or a number)")


def json_depth(text: str) -> int:
    """Deepest nesting of brackets outside strings (0 for a scalar)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_json(text: str) -> Any:
    """Parse JSON strictly: duplicate keys, NaN/Infinity and nesting beyond MAX_DEPTH are
    refused.

    Raises ParseProblem with the line and column of a syntax error.
    """
    if text.count("[") + text.count("{") > MAX_DEPTH and json_depth(text) > MAX_DEPTH:
        raise ParseProblem(f"nested {json_depth(text)} levels deep (at most {MAX_DEPTH})")
    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_no_constant)
    except ParseProblem:
        raise
    except json.JSONDecodeError as exc:
        raise ParseProblem(exc.msg, exc.lineno, exc.colno) from None
    except RecursionError:
        raise ParseProblem(f"nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ParseProblem(f"a value cannot be read: {str(exc)[:120]}") from None
