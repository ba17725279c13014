"""The base of every typed record and of the typed pieces nested in one.

`Record.read(path)` reads a record file and checks it; `Kind.of(path, raw, where)` checks an
object already parsed: a whole record (`where` "") or a piece nested in one (`where` says where
in the record, e.g. `runs[2].primary`). Every check raises the same located `StudyError`
(`damaged`): the file, the place in it, the field and what was found.

A kind declares each field once, as a dataclass attribute; its annotation is the check:

- `str`, `int`, `bool`, `float` (an int is a float too), `list[...]`, `dict[...]` and unions of
  them: the JSON value must be one of these (true/false is never a number);
- a field whose annotation lacks `None` must be present; one with `| None` may be absent or
  null (older records, optional parts) and reads as None then;
- `RENAMED` maps a JSON name that is a Python keyword to its attribute (`{"pass": "passed"}`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from tunelab.core.errors import StudyError
from tunelab.core.records import read_json

__all__ = ["Record", "as_written", "damaged", "field_types", "mapping_of"]

R = TypeVar("R", bound="Record")
_ABSENT = object()
_BASE_FIELDS = ("path", "raw", "where")


def as_written(name: str) -> property:
    """A field whose value may be any JSON (a prediction, a config value): read as written."""
    return property(lambda self: self.raw.get(name), doc=f"the record's {name!r}, as written")


def damaged(path: Path | str, what: str) -> StudyError:
    """The one error for a record that reads as JSON but not as its kind."""
    return StudyError(
        f"{path}: {what}: the record is damaged",
        hint="restore it from a copy; records are never rewritten by tunelab",
    )


def _type_name(kinds: tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false"}
    return " or ".join(names.get(t, t.__name__) for t in kinds if t is not type(None))


def _json_types(hint: Any) -> tuple[type, ...]:
    """The JSON types an annotation admits, in its order (`float` admits an int first)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found: list[type] = []
        for arg in typing.get_args(hint):
            found += [t for t in _json_types(arg) if t not in found]
        return tuple(found)
    if hint is float:
        return (int, float)
    kind = typing.get_origin(hint) or hint
    if kind not in (str, int, bool, list, dict, type(None)):
        raise TypeError(f"a record field's annotation must be a JSON type, not {hint!r}")
    return (kind,)


@functools.cache
def field_types(cls: type[Record]) -> dict[str, tuple[type, ...]]:
    """{JSON name: the types it admits} of a kind, from its dataclass fields' annotations."""
    hints = typing.get_type_hints(cls)
    json_name = {attr: name for name, attr in cls.RENAMED.items()}
    return {
        json_name.get(f.name, f.name): _json_types(hints[f.name])
        for f in dataclasses.fields(cls)
        if f.name not in _BASE_FIELDS
    }


@dataclass(frozen=True)
class Record:
    """A record read back: its path, its whole JSON object, and its kind's typed fields."""

    # a field whose JSON name is a Python keyword, read as this attribute ({"pass": "passed"})
    RENAMED: ClassVar[dict[str, str]] = {}

    path: Path
    raw: dict[str, Any] = field(repr=False)
    where: str = field(default="", kw_only=True)  # a nested piece: where in its record file

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "FIELDS" in vars(cls) or "OPTIONAL" in vars(cls):
            raise TypeError(
                f"{cls.__name__}: declare each field once, as an annotated dataclass attribute "
                "(`| None` when it may be absent); FIELDS and OPTIONAL are derived from them"
            )

    @classmethod
    def read(cls: type[R], path: Path | str) -> R:
        """Read and check the record at `path` (see the module docstring for the errors)."""
        return cls.of(path, read_json(Path(path)))

    @classmethod
    def of(cls: type[R], path: Path | str, raw: Any, where: str = "") -> R:
        """Check an already parsed record (or the piece of one at `where`) read from `path`."""
        at = f"{where}: " if where else ""
        if not isinstance(raw, dict):
            raise damaged(path, f"{at}a {type(raw).__name__}, not a JSON object")
        values = {}
        for name, kinds in field_types(cls).items():
            value = raw.get(name, _ABSENT)
            if value is _ABSENT or value is None:
                if type(None) not in kinds:
                    raise damaged(path, f"{at}field {name!r} is missing")
                value = None
            elif not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise damaged(path, f"{at}field {name!r} is {value!r}, not {_type_name(kinds)}")
            values[cls.RENAMED.get(name, name)] = value
        record = cls(Path(path), raw, where=where, **values)
        record.check_parts()
        return record

    def check_parts(self) -> None:
        """Check the typed pieces this kind reads lazily (a kind with nested pieces reads them
        all here, so a damaged piece is found when the record is read)."""

    def get(self, key: str, default: Any = None) -> Any:
        """A field no class names yet, read as written."""
        return self.raw.get(key, default)

    def part(self, cls: type[R], name: str) -> R | None:
        """The piece `name` of this record as `cls` (None when it is absent)."""
        value = self.raw.get(name)
        return None if value is None else cls.of(self.path, value, self._at(name))

    def parts(self, cls: type[R], name: str) -> list[R]:
        """The list `name` of this record, each item as `cls` ([] when it is absent)."""
        items = self.raw.get(name) or []
        if not isinstance(items, list):
            raise damaged(self.path, f"{self._at(name)}: {items!r}, not a list")
        return [cls.of(self.path, item, f"{self._at(name)}[{i}]") for i, item in enumerate(items)]

    def parts_by_key(self, cls: type[R], name: str) -> dict[str, R]:
        """The mapping `name` of this record, each value as `cls` ({} when it is absent)."""
        return mapping_of(cls, self.path, self.raw.get(name), self._at(name))

    def _at(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name


def mapping_of(cls: type[R], path: Path | str, items: Any, where: str) -> dict[str, R]:
    """The JSON object `items` found at `where` in the record at `path`, each value as `cls`
    ({} for None)."""
    if items is None:
        return {}
    if not isinstance(items, Mapping):
        raise damaged(path, f"{where}: {items!r}, not an object")
    return {k: cls.of(path, v, f"{where}.{k}") for k, v in items.items()}
