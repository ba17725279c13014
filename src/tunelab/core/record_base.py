"""The base of every typed record and of the typed pieces nested in one.

`Record.read(path)` reads a record file and checks it; `Kind.of(path, raw, where)` checks an
object already parsed: a whole record (`where` "") or a piece nested in one (`where` says where
in the record, e.g. `runs[2].primary`). Every check raises the same located `StudyError`
(`damaged`): the file, the place in it, the field and what was found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from tunelab.core.errors import StudyError
from tunelab.core.records import read_json

__all__ = [
    "NUM",
    "mapping_of",
    "OPT_DICT",
    "OPT_INT",
    "OPT_LIST",
    "OPT_NUM",
    "OPT_STR",
    "Record",
    "damaged",
]

R = TypeVar("R", bound="Record")
_ABSENT = object()

NUM = (int, float)
OPT_STR = (str, type(None))
OPT_INT = (int, type(None))
OPT_NUM = (int, float, type(None))
OPT_DICT = (dict, type(None))
OPT_LIST = (list, type(None))
OPT_BOOL = (bool, type(None))


def as_written(name: str) -> property:
    """A field whose value may be any JSON (a prediction, a config value): read as written."""
    return property(lambda self: self.raw.get(name), doc=f"the record's {name!r}, as written")


def damaged(path: Path | str, what: str) -> StudyError:
    """The one error for a record that reads as JSON but not as its kind."""
    return StudyError(
        f"{path}: {what}: the record is damaged",
        hint="restore it from a copy; records are never rewritten by tunelab",
    )


def _type_name(types: tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false"}
    return " or ".join(names.get(t, t.__name__) for t in types if t is not type(None))


@dataclass(frozen=True)
class Record:
    """A record read back: its path, its whole JSON object, and its kind's typed fields."""

    FIELDS: ClassVar[dict[str, tuple[type, ...]]] = {}
    # fields a record of this kind may lack (older tunelab versions, optional parts): None then
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    # a field whose JSON name is a Python keyword, read as this attribute ({"pass": "passed"})
    RENAMED: ClassVar[dict[str, str]] = {}

    path: Path
    raw: dict[str, Any] = field(repr=False)
    where: str = field(default="", kw_only=True)  # a nested piece: where in its record file

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
        for name, types in cls.FIELDS.items():
            value = raw.get(name, _ABSENT)
            if value is _ABSENT or value is None:
                if name not in cls.OPTIONAL and type(None) not in types:
                    raise damaged(path, f"{at}field {name!r} is missing")
                value = None
            elif not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise damaged(path, f"{at}field {name!r} is {value!r}, not {_type_name(types)}")
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
