"""Readers: JSONL, CSV, Parquet, a folder of text files per label, a `datasets` dataset on disk,
a hub data set in the snapshot folder `data.hub` fetched at its pinned commit.

Each reader yields `SourceRow`s (raw id, text, label, target, user split) with `where`, the place
a message names ("data.jsonl line 12"), and lists the files it read with their sha256. Bad input
raises `DataError` naming the file, the line (or row) and the field, with the fix.

`read_source(root, cfg, progress)` -> `SourceData`, through the reader of the configured format
(`tunelab.stages.data.formats`); `SourceRow.label_raw` is the label as written; `SourceData.hub`
becomes `manifest["source"]["hub"]` = `{repo_id, repo_type, revision, commit, config, splits
{name: rows}, fingerprints, datasets}`. What a row and a source are, and which files a source
may read: `tunelab.stages.data.source_files`.
`source_problems(path, data_cfg)` is what `tunelab validate` checks of the data without reading
it. Config: `data.source.encoding_errors: error | replace`, `data.source.follow_links` (links
followed are listed in `manifest["source"]["links_followed"]`, present only then),
`data.invalid_targets: refuse | keep`.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from pathlib import Path

from tunelab.core.config_sections import DataConfig
from tunelab.core.errors import DataError
from tunelab.core.progress import Progress, silent
from tunelab.core.strict_load import loads_json
from tunelab.stages.data.formats import (
    csv_separator_error,
    other_separator,
    read_csv,
    read_folder,
    read_hf_disk,
    read_hub,
    read_jsonl,
    read_parquet,
)
from tunelab.stages.data.source_files import (
    EXTENSIONS,
    FieldMapper,
    RowCount,
    SourceData,
    SourceRow,
    column_list,
    container_of,
    files_of,
)


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
        read_folder(src, cfg, mapper, errors, count)
    elif fmt == "hf_disk":
        read_hf_disk(src, mapper, count)
    elif fmt == "hub":  # a data set in the hub cache, at its pinned commit (`data.hub`)
        read_hub(src, cfg, mapper, count)
    else:
        reader = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet}[fmt]
        for path in files_of(root, EXTENSIONS[fmt], cfg.source.follow_links, src):
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
        refused = csv_separator_error(path.name, sep)
        return [f"data.source.path: {refused.message} ({refused.hint})"]
    shown = column_list(columns)
    return [
        f"data.fields.{key}: column {col!r} is not in {path.name} (it has: {shown})"
        for key, col in FieldMapper(cfg.fields, fmt).mapped().items()
        if col not in columns
    ]
