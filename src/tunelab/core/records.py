"""Atomic, never-overwritten record files.

Every record is written to a temporary name in the same folder, fsynced, then moved into place
with os.replace, so a kill leaves either the old state or the new one, never half a file.

`write_json_atomic`, `write_jsonl_atomic`, `write_bytes_atomic` refuse to overwrite unless
`overwrite=True`; `append_jsonl`, `read_json`, `read_jsonl`; `temp_dir_beside` + `publish_dir`
make a folder record appear in one rename (with its DONE marker written last);
`safe_join(root, relative)` refuses a path that leaves its folder. Digests live in
core/hashing, the typed record kinds in core/record_types, the latest of a kind in
core/evidence.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunelab.core.errors import StudyError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, *, overwrite: bool = False) -> Path:
    """Write `data` to `path` atomically. Refuses to replace a finished record unless `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise StudyError(
            f"{path} already exists; records are never overwritten",
            hint="a rerun writes a new record with a new id",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False, default=str) + "\n"


def write_json_atomic(path: Path, obj: Any, *, overwrite: bool = False) -> Path:
    return write_bytes_atomic(path, dumps_json(obj).encode("utf-8"), overwrite=overwrite)


def write_jsonl_atomic(path: Path, rows: Iterable[Any], *, overwrite: bool = False) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
    return write_bytes_atomic(path, text.encode("utf-8"), overwrite=overwrite)


def append_jsonl(path: Path, row: Any) -> None:
    """Append one line and fsync; metrics streams are append-only logs, not replaced records."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StudyError(f"{path}: record not found") from None
    except json.JSONDecodeError as exc:
        raise StudyError(
            f"{path}: not valid JSON (line {exc.lineno}): the record is damaged",
            hint="restore it from a copy; records are never rewritten by tunelab",
        ) from None


def read_jsonl(path: Path) -> list[Any]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def publish_dir(tmp_dir: Path, final_dir: Path) -> Path:
    """Move a fully written temporary folder into place (one rename) and mark it DONE."""
    if final_dir.exists():
        raise StudyError(f"{final_dir} already exists; records are never overwritten")
    (tmp_dir / "DONE").write_text("")
    _fsync_dir(tmp_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    return final_dir


def temp_dir_beside(final_dir: Path) -> Path:
    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def safe_join(root: Path, relative: str) -> Path:
    """Join `relative` under `root`, refusing paths that escape it (.., absolute, symlinks out)."""
    root = Path(root).resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise StudyError(
            f"path {relative!r} escapes {root}", hint="records only name files inside their folder"
        )
    return target
