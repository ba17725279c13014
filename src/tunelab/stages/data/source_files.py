"""What a data reader yields and where it may read from: `SourceRow` (raw id, text, label,
target, user split, and `where`, the place a message names), `SourceData` (the rows and the
files read with their sha256), `FieldMapper` (a source's columns to an example's fields), the
decoding of bytes, and the files of a source (containers refused, links followed only when
asked). The readers of each format: `tunelab.stages.data.formats`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.config_sections import FieldsConfig
from tunelab.core.errors import DataError, preview
from tunelab.core.hashing import sha256_bytes

SPLIT_NAMES = ("train", "validation", "test")
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
    "testing": "test",
}
# hf_disk: the name of a DatasetDict's split, usable as `fields.split`.
HF_SPLIT_COLUMN = "__split__"
EXTENSIONS = {"jsonl": ("*.jsonl", "*.json"), "csv": ("*.csv",), "parquet": ("*.parquet",)}

# n more rows read: the readers' tally, which `read_source` reports as progress
RowCount = Callable[[int], None]
PROGRESS_EVERY = 10_000  # rows between progress updates


@dataclass
class SourceRow:
    text: str
    label: str | None
    target: str | None
    id: str | None
    split: str | None
    where: str
    label_raw: Any = None  # the label as written (a number or a string, spaces kept)


@dataclass
class SourceData:
    rows: list[SourceRow]
    files: list[dict[str, Any]]  # {"path": relative to the source root, "sha256", "bytes"}
    root: Path
    notes: list[str] = field(default_factory=list)  # warnings for the report
    replaced_bytes: int = 0  # invalid UTF-8 bytes replaced (encoding_errors: replace)
    links: list[dict[str, str]] = field(default_factory=list)  # followed: {path, target}
    hub: dict[str, Any] | None = None  # format hub: repo, commit, config, splits, fingerprints


# ---------------------------------------------------------------- field values


def column_list(names: list[str], limit: int = 30) -> str:
    """'id, text, label' for a message: at most `limit` names, each cut to 40 characters."""
    shown = ", ".join(str(n)[:40] for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)  # NaN


class FieldMapper:
    """Turns one source record (a mapping) into a SourceRow, checking each mapped field."""

    def __init__(self, fields: FieldsConfig, fmt: str):
        self.fields = fields
        self.fmt = fmt

    def mapped(self) -> dict[str, str]:
        f = self.fields
        out = {"text": f.text}
        for key in ("label", "target", "id", "split"):
            if getattr(f, key):
                out[key] = getattr(f, key)
        return out

    def check_columns(self, columns: list[str], where: str) -> None:
        """Every mapped field must be a column of the source (CSV header, Parquet schema), and
        no column name may appear twice (one of the two would be dropped silently)."""
        twice = sorted(c for c, n in Counter(columns).items() if n > 1 and c)
        if twice:
            places = [
                f"{c!r} (columns {', '.join(str(i + 1) for i, x in enumerate(columns) if x == c)})"
                for c in twice[:5]
            ]
            raise DataError(
                f"{where}: column name given twice: {'; '.join(places)}",
                hint="rename or remove the repeated column so that each name is unique",
            )
        missing = [(k, c) for k, c in self.mapped().items() if c not in columns]
        if missing:
            key, col = missing[0]
            raise DataError(
                f"{where}: no column {col!r} for field {key!r} (columns: {column_list(columns)})",
                hint=f"set data.fields.{key} to one of the columns"
                + (", or to null if the data has none" if key != "text" else ""),
            )

    def row(self, rec: Any, where: str) -> SourceRow:
        if not isinstance(rec, dict):
            raise DataError(
                f"{where}: expected an object with fields, found {type(rec).__name__}",
                hint='each line must be a JSON object like {"text": ..., "label": ...}',
            )
        f = self.fields
        text = self._get(rec, "text", f.text, where, required=True)
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field {f.text!r} (text) must be a string, found {type(text).__name__}",
                hint="fix the row, or map data.fields.text to the column holding the text",
            )
        label = self._scalar(rec, "label", f.label, where) if f.label else None
        label_raw = rec.get(f.label) if f.label else None
        target = None
        if f.target:
            value = self._get(rec, "target", f.target, where, required=True)
            target = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        row_id = self._scalar(rec, "id", f.id, where) if f.id else None
        split = None
        if f.split:
            raw = self._scalar(rec, "split", f.split, where)
            split = SPLIT_ALIASES.get(str(raw).strip().lower())
            if split is None:
                raise DataError(
                    f"{where}: field {f.split!r} (split) is {preview(raw)}, not a split name",
                    hint="use train, validation or test (aliases: valid, val, dev, testing)",
                )
        for key, value in (("text", text), ("label", label), ("target", target), ("id", row_id)):
            if value is not None:
                _refuse_surrogates(value, getattr(f, key), key, where)
        return SourceRow(text, label, target, row_id, split, where, label_raw)

    def _get(self, rec: dict, key: str, col: str, where: str, required: bool) -> Any:
        if col not in rec or not _present(rec[col]):
            if not required:
                return None
            state = "missing" if col not in rec else "null"
            keys = column_list(list(rec)) or "none"
            raise DataError(
                f"{where}: field {col!r} ({key}) is {state} (fields present: {keys})",
                hint=f"add {col!r} to this row, or set data.fields.{key} to the right column",
            )
        return rec[col]

    def _scalar(self, rec: dict, key: str, col: str, where: str) -> str:
        value = self._get(rec, key, col, where, required=True)
        if isinstance(value, bool) or not isinstance(value, str | int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise DataError(
                    f"{where}: field {col!r} ({key}) must be a string or an integer, "
                    f"found {type(value).__name__} {preview(value)}",
                    hint=f"fix the value of {col!r} in this row",
                )
        text = str(value).strip()
        if not text:
            raise DataError(
                f"{where}: field {col!r} ({key}) is empty",
                hint=f"give this row a {key}, or remove the row",
            )
        return text


def _refuse_surrogates(value: str, col: str, key: str, where: str) -> None:
    """A JSON escape such as \\ud800 without its pair decodes to a lone surrogate, which no
    UTF-8 file (a snapshot, a record) can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = value[exc.start]
        raise DataError(
            f"{where}: field {col!r} ({key}) holds a lone surrogate \\u{ord(char):04x} at "
            f"character {exc.start + 1}: half of a UTF-16 pair, not text",
            hint="fix the escape in this row (a whole pair such as \\ud83d\\ude00 is fine), "
            "or remove the row",
        ) from None


# ---------------------------------------------------------------- decoding


def decode_bytes(data: bytes, where: str, errors: str, src: SourceData) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if errors == "replace":
            src.replaced_bytes += exc.end - exc.start
            text = data.decode("utf-8", errors="replace")
            src.replaced_bytes += max(0, text.count("\ufffd") - 1)
            return text
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(
            f"{where}: invalid UTF-8 at line {line}, column {col} "
            f"(byte {data[exc.start]:#04x}, {exc.reason})",
            hint="re-save the file as UTF-8, or set data.source.encoding_errors: replace "
            "to replace undecodable bytes with U+FFFD",
        ) from None


# What a file is when it is not UTF-8 text, by its first bytes: (magic, what, how to convert).
_CONTAINERS = [
    (b"\xff\xfe\x00\x00", "UTF-32 text", "iconv -f UTF-32 -t UTF-8 {name} > {out}"),
    (b"\x00\x00\xfe\xff", "UTF-32 text", "iconv -f UTF-32 -t UTF-8 {name} > {out}"),
    (b"\xff\xfe", "UTF-16 text", "iconv -f UTF-16 -t UTF-8 {name} > {out}"),
    (b"\xfe\xff", "UTF-16 text", "iconv -f UTF-16 -t UTF-8 {name} > {out}"),
    (b"\x1f\x8b", "gzip-compressed", "gunzip -c {name} > {out}"),
    (b"\xfd7zXZ\x00", "xz-compressed", "xz -dc {name} > {out}"),
    (b"(\xb5/\xfd", "zstd-compressed", "zstd -dc {name} > {out}"),
    (
        b"PK\x03\x04",
        "a zip archive (an .xlsx workbook is one)",
        "unzip it, or save the sheet as CSV",
    ),
]
_BZIP2 = b"1AY&SY"  # after "BZh" and the block size digit


def container_of(data: bytes) -> tuple[str, str] | None:
    """(what the bytes are, how to convert them) when they are not plain text, else None."""
    for magic, what, fix in _CONTAINERS:
        if data.startswith(magic):
            return what, fix
    if data[:3] == b"BZh" and data[4:10] == _BZIP2:
        return "bzip2-compressed", "bunzip2 -c {name} > {out}"
    if data[:4] == b"PAR1" and data[-4:] == b"PAR1":
        return "a Parquet file", "set data.source.format: parquet"
    head = data[:4096]
    if b"\x00" in head:
        even, odd = head[0::2].count(0), head[1::2].count(0)
        if max(even, odd) > len(head) // 4 and min(even, odd) == 0:
            return (
                "UTF-16 text (without a byte-order mark)",
                "iconv -f UTF-16LE -t UTF-8 {name} > {out}",
            )
        return "binary (it holds NUL bytes)", "point data.source.path at a text file"
    return None


def refuse_container(data: bytes, path: Path, name: str, fmt: str) -> None:
    found = container_of(data)
    if found is not None:
        what, fix = found
        out = f"{path.stem}-utf8{path.suffix}" if "iconv" in fix else path.stem
        raise DataError(
            f"{name}: this file is {what}, not UTF-8 text ({fmt})",
            hint="convert it first: " + fix.format(name=path.name, out=out or "data"),
        )


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def contained_path(path: Path, root: Path, follow: bool, src: SourceData) -> Path | None:
    """`path` (found under `root`) if it stays inside the data folder once every link is
    resolved; a link leaving it is refused, or with `follow` read and recorded."""
    real = path.resolve()
    if _inside(real, root.resolve()):
        return path
    rel = relative_name(path, root)
    if not follow:
        raise DataError(
            f"{rel}: a symbolic link to {real}, outside the data folder {root}",
            hint="copy the file into the data folder, or set data.source.follow_links: true "
            "to read it (the snapshot manifest then lists every such link)",
        )
    src.links.append({"path": rel, "target": str(real)})
    return path


def files_of(path: Path, patterns: tuple[str, ...], follow: bool, src: SourceData) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted({p for pat in patterns for p in path.rglob(pat) if p.is_file()})
        if not found:
            raise DataError(
                f"{path}: no files matching {' or '.join(patterns)}",
                hint="point data.source.path at a file or a folder holding them",
            )
        others = sorted(
            str(p.relative_to(path))
            for p in path.rglob("*")
            if p.is_file()
            and p not in found
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if others:  # a .tsv or an upper-case .CSV beside the data would be left out unseen
            shown = ", ".join(others[:5]) + (
                f" and {len(others) - 5} more" if len(others) > 5 else ""
            )
            src.notes.append(
                f"skipped {len(others)} file(s) in {path.name} not matching "
                f"{' or '.join(patterns)}: {shown}"
            )
        return [p for p in found if contained_path(p, path, follow, src)]
    raise DataError(f"{path}: no such file or folder", hint="fix data.source.path in study.yaml")


def relative_name(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root)) if path != root else path.name
    except ValueError:
        return str(path)


def record_file(src: SourceData, path: Path, data: bytes) -> None:
    rel = relative_name(path, src.root) if src.root.is_dir() else path.name
    src.files.append({"path": rel, "sha256": sha256_bytes(data), "bytes": len(data)})
