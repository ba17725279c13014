"""The readers, one per `data.source.format`: JSONL, CSV, Parquet, a folder of text files per
label, a `datasets` dataset on disk, a hub data set in the snapshot folder `data.hub` fetched at
its pinned commit. Each adds `SourceRow`s to a `SourceData` (`tunelab.stages.data.source_files`).

`read_hub` reads a hub data set (`data.source.format: hub`: `name`, `config`, `revision`,
`splits`; no `path`) from the snapshot folder `tunelab.stages.data.hub.fetch_dataset` leaves;
`check_inferred_targets` refuses a target column `datasets` types as other than text from JSON /
CSV files. `load_hf_disk(src)` / `load_hub(src, cfg)` give the loaded data set (the image
sources read it too).
"""

from __future__ import annotations

import csv
import io
import os
import sys
from pathlib import Path
from typing import Any

from tunelab.core.config_sections import DataConfig
from tunelab.core.errors import DataError, preview
from tunelab.core.hashing import sha256_file
from tunelab.core.strict_load import ParseProblem, loads_json
from tunelab.stages.data.leftovers import leftover_file, leftover_folder
from tunelab.stages.data.source_files import (
    HF_SPLIT_COLUMN,
    PROGRESS_EVERY,
    FieldMapper,
    RowCount,
    SourceData,
    SourceRow,
    contained_path,
    decode_bytes,
    record_file,
    refuse_container,
    relative_name,
)

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


def read_jsonl(
    src: SourceData, path: Path, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    data = path.read_bytes()
    record_file(src, path, data)
    name = relative_name(path, src.root) if src.root.is_dir() else path.name
    refuse_container(data, path, name, "JSON lines")
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        data = data[3:]
    first = True
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{name} line {lineno}"
        line = decode_bytes(raw, where, errors, src)
        try:
            rec = loads_json(line)
        except ParseProblem as exc:
            if first and (whole := _not_json_lines(decode_bytes(data, name, "replace", src), name)):
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


def csv_separator_error(name: str, sep: str) -> DataError:
    word, escaped = SEPARATORS[sep]
    return DataError(
        f"{name} line 1 (header): the columns are separated by {word}, not commas; "
        "format csv reads comma-separated values only",
        hint="convert it to Parquet (every value kept as text) and set data.source.format: "
        'parquet: python -c "import pandas as pd; '
        f"pd.read_csv('{name}', sep='{escaped}', dtype=str, keep_default_na=False)"
        f".to_parquet('{Path(name).stem}.parquet')\"",
    )


def read_csv(
    src: SourceData, path: Path, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    data = path.read_bytes()
    record_file(src, path, data)
    name = relative_name(path, src.root) if src.root.is_dir() else path.name
    refuse_container(data, path, name, "CSV")
    text = decode_bytes(data, name, errors, src)
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
            raise csv_separator_error(name, sep)
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


def read_parquet(
    src: SourceData, path: Path, mapper: FieldMapper, errors: str, progress: RowCount
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = path.read_bytes()
    record_file(src, path, data)
    name = relative_name(path, src.root) if src.root.is_dir() else path.name
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


def read_folder(
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
        and contained_path(p, root, follow, src)
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
            contained_path(path, root, follow, src)
            data = path.read_bytes()
            record_file(src, path, data)
            rel = relative_name(path, root)
            refuse_container(data, path, rel, "text")
            text = decode_bytes(data, f"{rel} (field text)", errors, src)
            if text.startswith("\ufeff"):
                text = text[1:]
            src.rows.append(SourceRow(text, folder.name, None, rel, None, rel, folder.name))
            progress(1)
    if left:
        src.notes.append(leftovers_note(left, root))


def leftovers_note(left: list[Path], root: Path) -> str:
    """The note naming the OS / archiver / notebook leftovers a folder source skipped."""
    shown = ", ".join(
        f"{relative_name(p, root)}{'/' if p.is_dir() else ''} "
        f"({leftover_folder(p.name) or leftover_file(p.name)})"
        for p in sorted(left)[:5]
    )
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    return f"skipped {len(left)} leftover(s) of operating systems, archivers or notebooks: {shown}{more}"


def read_hf_disk(src: SourceData, mapper: FieldMapper, progress: RowCount) -> None:
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
        contained_path(path, root, False, src)  # datasets reads these files: none may leave root
        record_file(src, path, path.read_bytes())
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
