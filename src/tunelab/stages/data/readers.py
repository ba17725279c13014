"""Readers: JSONL, CSV, Parquet, a folder of text files per label, a `datasets` dataset on disk,
a hub data set in the snapshot folder `data.hub` fetched at its pinned commit.

Each reader yields `SourceRow`s (raw id, text, label, target, user split) with `where`, the place
a message names ("data.jsonl line 12"), and lists the files it read with their sha256. Bad input
raises `DataError` naming the file, the line (or row) and the field, with the fix.

`read_source(root, cfg, progress)` -> `SourceData`; `SourceRow.label_raw` is the label as
written; `SourceData.hub` becomes `manifest["source"]["hub"]` = `{repo_id, repo_type, revision,
commit, config, splits {name: rows}, fingerprints, datasets}`. `read_hub` reads a hub data set
(`data.source.format: hub`: `name`, `config`, `revision`, `splits`; no `path`) from the snapshot
folder `tunelab.stages.data.hub.fetch_dataset` leaves; `check_inferred_targets` refuses a target
column `datasets` types as other than text from JSON / CSV files. `load_hf_disk(src)` /
`load_hub(src, cfg)` give the loaded data set (the image sources read it too).
`source_problems(path, data_cfg)` is what `tunelab validate` checks of the data without reading
it. Config: `data.source.encoding_errors: error | replace`, `data.source.follow_links` (links
followed are listed in `manifest["source"]["links_followed"]`, present only then),
`data.invalid_targets: refuse | keep`.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.config_sections import DataConfig, FieldsConfig
from tunelab.core.errors import DataError, preview
from tunelab.core.hashing import sha256_bytes, sha256_file
from tunelab.core.progress import Progress, silent
from tunelab.core.strict_load import ParseProblem, loads_json
from tunelab.stages.data.leftovers import leftover_file, leftover_folder

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


def _decode(data: bytes, where: str, errors: str, src: SourceData) -> str:
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


def _refuse_container(data: bytes, path: Path, name: str, fmt: str) -> None:
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


def _contained(path: Path, root: Path, follow: bool, src: SourceData) -> Path | None:
    """`path` (found under `root`) if it stays inside the data folder once every link is
    resolved; a link leaving it is refused, or with `follow` read and recorded."""
    real = path.resolve()
    if _inside(real, root.resolve()):
        return path
    rel = _rel(path, root)
    if not follow:
        raise DataError(
            f"{rel}: a symbolic link to {real}, outside the data folder {root}",
            hint="copy the file into the data folder, or set data.source.follow_links: true "
            "to read it (the snapshot manifest then lists every such link)",
        )
    src.links.append({"path": rel, "target": str(real)})
    return path


def _files_of(path: Path, patterns: tuple[str, ...], follow: bool, src: SourceData) -> list[Path]:
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
        return [p for p in found if _contained(p, path, follow, src)]
    raise DataError(f"{path}: no such file or folder", hint="fix data.source.path in study.yaml")


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root)) if path != root else path.name
    except ValueError:
        return str(path)


def _record_file(src: SourceData, path: Path, data: bytes) -> None:
    rel = _rel(path, src.root) if src.root.is_dir() else path.name
    src.files.append({"path": rel, "sha256": sha256_bytes(data), "bytes": len(data)})


# ---------------------------------------------------------------- formats


def _not_json_lines(text: str, name: str) -> DataError | None:
    """A whole-file JSON document (an array, or pretty-printed objects) named as such."""
    body = text.lstrip()
    if not body.startswith(("[", "{")):
        return None
    try:
        whole = loads_json(body)
    except ParseProblem:
        whole = None
    if isinstance(whole, list):
        return DataError(
            f"{name}: the file is one JSON array of {len(whole)} item(s), not JSON lines "
            "(one object per line)",
            hint=f"convert it: jq -c '.[]' {name} > {Path(name).stem}-lines.jsonl "
            "(or set data.source.format to match the file)",
        )
    if isinstance(whole, dict) or body.startswith("{\n") or body.startswith("[\n"):
        return DataError(
            f"{name} line 1: pretty-printed JSON spread over several lines, not JSON lines "
            "(one object per line)",
            hint=f"convert it: jq -c '.' {name} > {Path(name).stem}-lines.jsonl",
        )
    return None


def _read_jsonl(
    src: SourceData, path: Path, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    data = path.read_bytes()
    _record_file(src, path, data)
    name = _rel(path, src.root) if src.root.is_dir() else path.name
    _refuse_container(data, path, name, "JSON lines")
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        data = data[3:]
    first = True
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{name} line {lineno}"
        line = _decode(raw, where, errors, src)
        try:
            rec = loads_json(line)
        except ParseProblem as exc:
            if first and (whole := _not_json_lines(_decode(data, name, "replace", src), name)):
                raise whole from None
            col = f", column {exc.column}" if exc.column else ""
            raise DataError(
                f"{where}{col}: not valid JSON ({exc.problem})",
                hint="each line must hold one JSON object; fix or remove this line",
            ) from None
        if first and isinstance(rec, list):
            raise _not_json_lines(line, name) or DataError(f"{where}: a JSON array")
        first = False
        src.rows.append(mapper.row(rec, where))
        if len(src.rows) % PROGRESS_EVERY == 0:
            progress(PROGRESS_EVERY)


def other_separator(header: list[str]) -> str | None:
    """The separator a one-column CSV header holds instead of commas (a TSV file, or a
    spreadsheet's semicolon export), named for the message; None otherwise."""
    if len(header) != 1:
        return None
    for sep in SEPARATORS:
        if sep in header[0]:
            return sep
    return None


SEPARATORS = {"\t": ("tabs", "\\t"), ";": ("semicolons", ";"), "|": ("vertical bars", "|")}


def _csv_separator_error(name: str, sep: str) -> DataError:
    word, escaped = SEPARATORS[sep]
    return DataError(
        f"{name} line 1 (header): the columns are separated by {word}, not commas; "
        "format csv reads comma-separated values only",
        hint="convert it to Parquet (every value kept as text) and set data.source.format: "
        'parquet: python -c "import pandas as pd; '
        f"pd.read_csv('{name}', sep='{escaped}', dtype=str, keep_default_na=False)"
        f".to_parquet('{Path(name).stem}.parquet')\"",
    )


def _read_csv(
    src: SourceData, path: Path, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    data = path.read_bytes()
    _record_file(src, path, data)
    name = _rel(path, src.root) if src.root.is_dir() else path.name
    _refuse_container(data, path, name, "CSV")
    text = _decode(data, name, errors, src)
    if text.startswith("\ufeff"):
        text = text[1:]
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    # csv's default 131,072-character field limit would refuse a long text the cleaning
    # rules (drop_longer_than) are there to handle, as the other readers do
    limit = csv.field_size_limit(sys.maxsize)
    start_line = 1
    try:
        header = next(reader, None)
        if header is None:
            return
        header = [h.strip() for h in header]
        if sep := other_separator(header):
            raise _csv_separator_error(name, sep)
        mapper.check_columns(header, f"{name} line 1 (header)")
        start_line = reader.line_num + 1
        for rec in reader:
            where = f"{name} line {start_line}"
            start_line = reader.line_num + 1
            if not rec or all(not v.strip() for v in rec):
                continue
            if len(rec) != len(header):
                raise DataError(
                    f"{where}: {len(rec)} fields, the header has {len(header)}",
                    hint="quote values that contain commas or newlines, or fix the row",
                )
            src.rows.append(mapper.row(dict(zip(header, rec, strict=True)), where))
            if len(src.rows) % PROGRESS_EVERY == 0:
                progress(PROGRESS_EVERY)
    except csv.Error as exc:
        # the record that failed starts at start_line; the reader stopped at line_num
        span = f" (the record starting here runs to line {reader.line_num})"
        span = span if reader.line_num > start_line else ""
        raise DataError(
            f"{name} line {start_line}: malformed CSV ({exc}){span}",
            hint="check the quoting on this line (a quote inside a value is written twice)",
        ) from None
    finally:
        csv.field_size_limit(limit)


def _read_parquet(
    src: SourceData, path: Path, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = path.read_bytes()
    _record_file(src, path, data)
    name = _rel(path, src.root) if src.root.is_dir() else path.name
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        mapper.check_columns(list(parquet.schema_arrow.names), name)
        # only the mapped columns are materialized
        table = parquet.read(columns=sorted(set(mapper.mapped().values())))
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{name}: not a readable Parquet file ({preview(str(exc), 200)})",
            hint="check the file",
        ) from None
    cols = {c: table.column(c).to_pylist() for c in set(mapper.mapped().values())}
    for i in range(table.num_rows):
        rec = {c: v[i] for c, v in cols.items()}
        src.rows.append(mapper.row(rec, f"{name} row {i}"))
        if len(src.rows) % PROGRESS_EVERY == 0:
            progress(PROGRESS_EVERY)


def _read_folder(
    src: SourceData, cfg: DataConfig, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    root = src.root
    follow = cfg.source.follow_links
    if not root.is_dir():
        raise DataError(
            f"{root}: not a folder (format: folder wants one sub-folder per label)",
            hint="fix data.source.path, or set data.source.format to the file's format",
        )
    left = [p for p in root.iterdir() if p.is_dir() and leftover_folder(p.name)]
    labels = sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and p not in left
        and _contained(p, root, follow, src)
    )
    stray = [p.name for p in root.glob(cfg.source.glob) if p.is_file()]
    if stray:
        src.notes.append(
            f"{len(stray)} file(s) directly in {root} ignored (not in a label folder): "
            + ", ".join(sorted(stray)[:5])
        )
    if not labels:
        raise DataError(
            f"{root}: no label folders (format: folder wants {root}/<label>/{cfg.source.glob})",
            hint="put each category's files in a sub-folder named after the category",
        )
    for folder in labels:
        files = sorted(p for p in folder.glob(cfg.source.glob) if p.is_file())
        left += [p for p in files if leftover_file(p.name)]
        files = [p for p in files if not leftover_file(p.name)]
        if not files:
            raise DataError(
                f"{folder}: label folder {folder.name!r} has no files matching {cfg.source.glob!r}",
                hint="remove the empty folder, or fix data.source.glob",
            )
        for path in files:
            _contained(path, root, follow, src)
            data = path.read_bytes()
            _record_file(src, path, data)
            rel = _rel(path, root)
            _refuse_container(data, path, rel, "text")
            text = _decode(data, f"{rel} (field text)", errors, src)
            if text.startswith("\ufeff"):
                text = text[1:]
            src.rows.append(SourceRow(text, folder.name, None, rel, None, rel, folder.name))
            progress(1)
    if left:
        src.notes.append(leftovers_note(left, root))


def leftovers_note(left: list[Path], root: Path) -> str:
    """The note naming the OS / archiver / notebook leftovers a folder source skipped."""
    shown = ", ".join(
        f"{_rel(p, root)}{'/' if p.is_dir() else ''} "
        f"({leftover_folder(p.name) or leftover_file(p.name)})"
        for p in sorted(left)[:5]
    )
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    return f"skipped {len(left)} leftover(s) of operating systems, archivers or notebooks: {shown}{more}"


def _read_hf_disk(src: SourceData, mapper: FieldMapper, progress: RowCount) -> None:
    add_dataset_rows(src, mapper, load_hf_disk(src), src.root.name, progress)


def load_hf_disk(src: SourceData) -> Any:
    """The Dataset or DatasetDict saved with `save_to_disk` at `src.root`, every file under it
    listed with its sha256."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise DataError(
            "format hf_disk needs the `datasets` package", hint="pip install datasets"
        ) from exc

    root = src.root
    if not root.is_dir():
        raise DataError(f"{root}: no such folder", hint="fix data.source.path in study.yaml")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        _contained(path, root, False, src)  # datasets reads these files: none may leave root
        _record_file(src, path, path.read_bytes())
    try:
        loaded = datasets.load_from_disk(str(root))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(
            f"{root}: not a dataset saved with save_to_disk ({exc})",
            hint="save it with `Dataset.save_to_disk(path)` or pick another data.source.format",
        ) from None
    return loaded


def add_dataset_rows(
    src: SourceData, mapper: FieldMapper, loaded: Any, name: str, progress: RowCount
) -> None:
    """The rows of a `datasets` Dataset or DatasetDict (its split names in HF_SPLIT_COLUMN),
    ClassLabel integers read as their names."""
    import datasets

    parts = list(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split_name, ds in parts:
        cols = list(ds.column_names) + ([HF_SPLIT_COLUMN] if split_name else [])
        where_ds = name + (f"[{split_name}]" if split_name else "")
        mapper.check_columns(cols, where_ds)
        names: dict[str, Any] = {}
        for col in mapper.mapped().values():
            feat = ds.features.get(col)
            if isinstance(feat, datasets.ClassLabel):
                names[col] = feat
        for i, rec in enumerate(ds):
            rec = dict(rec)
            if split_name:
                rec[HF_SPLIT_COLUMN] = split_name
            for col, feat in names.items():
                if isinstance(rec.get(col), int) and rec[col] >= 0:
                    rec[col] = feat.int2str(rec[col])
            src.rows.append(mapper.row(rec, f"{where_ds} row {i}"))
            progress(1)


def datasets_cache_dir() -> Path:
    """Where `datasets` keeps its Arrow files, from the environment now."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "datasets"


def read_hub(src: SourceData, cfg: DataConfig, mapper: FieldMapper, progress: Any) -> None:
    """Rows of the data set in the snapshot folder `src.root` (every file listed with its
    sha256); `src.hub` gets repo, commit, config, splits and the `datasets` fingerprints."""
    loaded = load_hub(src, cfg)
    check_inferred_targets(src, mapper, loaded, cfg.source.name)
    add_dataset_rows(src, mapper, loaded, cfg.source.name, progress)


# data files whose column types `datasets` infers from the values (Parquet and Arrow store theirs)
INFERRED_SUFFIXES = (".json", ".jsonl", ".jsonl.gz", ".csv", ".csv.gz", ".tsv")


def check_inferred_targets(src: SourceData, mapper: FieldMapper, loaded: Any, name: str) -> None:
    """Refuse a target column that `datasets` typed as other than text while reading JSON or
    CSV files: it rewrites such values on load (a string "3" among numbers becomes 3, a key one
    row lacks becomes null, "007" becomes 7), so the gold would not be what the files say."""
    import datasets

    column = mapper.mapped().get("target")
    inferred = [f["path"] for f in src.files if f["path"].endswith(INFERRED_SUFFIXES)]
    if column is None or not inferred:
        return
    for split, ds in loaded.items():
        feature = ds.features.get(column)
        if feature is None or (
            isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
        ):
            continue
        raise DataError(
            f"data set {name}[{split}] ({inferred[0]}): the target column {column!r} is read "
            f"by `datasets` as {preview(str(feature), 80)}, not as text: it rewrites such values "
            'when it loads them (a string "3" among numbers becomes 3, a key that a row lacks '
            "becomes null), so the gold would not be what the file says",
            hint=f"write each {column!r} value as a JSON string (json.dumps of the object), "
            "then lay the data set into the cache again (`tunelab hub-cache`), or store it as "
            "Parquet with the types you mean",
        )


def load_hub(src: SourceData, cfg: DataConfig) -> Any:
    """The DatasetDict in the hub snapshot folder `src.root` (the splits asked for), its files
    listed with their sha256 and `src.hub` filled in."""
    import datasets

    source, root = cfg.source, src.root
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        src.files.append({"path": rel, "sha256": sha256_file(path), "bytes": path.stat().st_size})
    where = f"data set {source.name}@{root.name[:12]}"
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:  # the library draws nothing: `datasets` would print its bars on stderr
        datasets.utils.disable_progress_bars()
    try:
        loaded = datasets.load_dataset(
            str(root), name=source.config, cache_dir=str(datasets_cache_dir())
        )
    except ValueError as exc:  # an unknown config names the ones there are
        raise DataError(
            f"{where}: {str(exc).splitlines()[0]}",
            hint="set data.source.config to one of the data set's configs (or remove it)",
        ) from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise DataError(
            f"{where}: no data files `datasets` can read ({exc})",
            hint="a hub data set needs Parquet, JSON Lines or CSV files (scripts are not run)",
        ) from None
    finally:
        if quiet:
            datasets.utils.enable_progress_bars()
    if source.splits:
        missing = [s for s in source.splits if s not in loaded]
        if missing:
            raise DataError(
                f"{where}: no split {missing[0]!r} (splits: {', '.join(loaded)})",
                hint="set data.source.splits to some of those, or remove it to read them all",
            )
        loaded = datasets.DatasetDict({s: loaded[s] for s in source.splits})
    src.hub = {
        "repo_id": source.name,
        "repo_type": "dataset",
        "revision": source.revision or "main",
        "commit": root.name,
        "config": source.config,
        "splits": {name: ds.num_rows for name, ds in loaded.items()},
        "fingerprints": {name: ds._fingerprint for name, ds in loaded.items()},
        "datasets": datasets.__version__,
    }
    if len(loaded) > 1 and cfg.fields.split != HF_SPLIT_COLUMN:
        src.notes.append(
            f"{source.name} has splits {', '.join(loaded)}: they are pooled and split again; "
            f"set data.fields.split: {HF_SPLIT_COLUMN} to keep them"
        )
    return loaded


def _row_counter(progress: Progress) -> RowCount:
    """The readers' tally, reported as `progress("reading", rows so far, None)`."""
    seen = [0]

    def add(n: int) -> None:
        seen[0] += n
        progress("reading", seen[0], None)

    return add


def read_source(root: Path, cfg: DataConfig, progress: Progress = silent) -> SourceData:
    """Read every row of the configured source. `root` is the resolved data.source.path;
    `progress("reading", rows, None)` (core.progress) as rows are read."""
    fmt = cfg.source.format
    errors = cfg.source.encoding_errors
    mapper = FieldMapper(cfg.fields, fmt)
    src = SourceData(rows=[], files=[], root=root)
    count = _row_counter(progress)
    if fmt != "hub":
        require_text_names(root)
    if fmt == "folder":
        _read_folder(src, cfg, mapper, errors, count)
    elif fmt == "hf_disk":
        _read_hf_disk(src, mapper, count)
    elif fmt == "hub":  # a data set in the hub cache, at its pinned commit (`data.hub`)
        read_hub(src, cfg, mapper, count)
    else:
        reader = {"jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet}[fmt]
        for path in _files_of(root, EXTENSIONS[fmt], cfg.source.follow_links, src):
            reader(src, path, mapper, errors, count)
    if src.links:
        src.notes.append(
            f"read {len(src.links)} file(s) through symbolic links that leave the data folder "
            f"(data.source.follow_links), e.g. {src.links[0]['path']} -> "
            f"{src.links[0]['target']}; the manifest lists every one (source.links_followed)"
        )
    return src


def escaped_name(name: str) -> str:
    """A file name as its bytes read, the bytes that are not UTF-8 as \\xNN."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def require_text_names(root: Path) -> None:
    """Refuse a data folder holding a file or folder name that is not valid UTF-8 (it could be
    neither recorded in the manifest nor shown), each named escaped."""
    bad = []
    for here, dirs, names in os.walk(root) if root.is_dir() else []:
        for name in dirs + names:
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                bad.append(escaped_name(str(Path(here, name).relative_to(root))))
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DataError(
            f"{escaped_name(str(root))}: {len(bad)} file or folder name(s) are not valid "
            f"UTF-8: {shown}",
            hint="rename them to UTF-8 (e.g. `convmv -f latin1 -t utf8 -r --notest FOLDER`), "
            "then run `tunelab data` again",
        )


def iter_texts(rows: list[SourceRow]) -> Iterator[str]:
    return (r.text for r in rows)


# ---------------------------------------------------------------- checks before reading


def _first_columns(path: Path, fmt: str) -> list[str] | None:
    """The column names the first file of the source declares (CSV header, Parquet schema, the
    first JSON line's keys), or None when they cannot be read cheaply (then `tunelab data`
    reports the problem at its line)."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        if container_of(head) is not None:
            return None
        lines = head.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="replace").splitlines()
        first = next((line for line in lines if line.strip()), None)
        if first is None:
            return None
        if fmt == "csv":
            return [h.strip() for h in next(csv.reader([first]))]
        rec = loads_json(first)
        return [str(k) for k in rec] if isinstance(rec, dict) else None
    except (OSError, ValueError, csv.Error, ImportError):
        return None
    except Exception:  # noqa: BLE001 - pyarrow's errors: `tunelab data` names them
        return None


def source_problems(path: Path, cfg: DataConfig) -> list[str]:
    """What `tunelab validate` can tell of the data without reading it: the source exists, and
    each mapped field names a column of its first file. One `field: problem` line each."""
    fmt = cfg.source.format
    if not path.exists():
        return [f"data.source.path: {path} does not exist"]
    if fmt not in ("jsonl", "csv", "parquet"):
        return []
    if path.is_dir():
        files = sorted(p for pat in EXTENSIONS[fmt] for p in path.rglob(pat) if p.is_file())
        if not files:
            return [f"data.source.path: no {' or '.join(EXTENSIONS[fmt])} file in {path}"]
        path = files[0]
    columns = _first_columns(path, fmt)
    if columns is None:
        return []
    if fmt == "csv" and (sep := other_separator(columns)):
        refused = _csv_separator_error(path.name, sep)
        return [f"data.source.path: {refused.message} ({refused.hint})"]
    shown = column_list(columns)
    return [
        f"data.fields.{key}: column {col!r} is not in {path.name} (it has: {shown})"
        for key, col in FieldMapper(cfg.fields, fmt).mapped().items()
        if col not in columns
    ]
