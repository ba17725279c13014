"""The header of a safetensors file, checked before any library loads it.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON naming each
tensor's dtype, shape and [begin, end) offsets into the data that follows, then the data. A
damaged file whose hashes were rewritten to match (or a file never hashed) must fail here, with
the file and the problem named, not later inside a loader as a traceback.

`header_problems(prefix, file_size)` is pure: `prefix` holds the file's first bytes (at least
8 + N, or the whole file if shorter). `safetensors_problems(path)` reads just that much.

`require_safetensors(paths, what)` raises CheckpointError naming every damaged file.
`tunelab.stages.train.checkpoint.read_checkpoint_state` runs it on every listed `.safetensors`
(a verify record's `checkpoint` gains `damaged {name: problem}`), and
`tunelab.stages.export.check` on an export's files.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

from tunelab.core.errors import CheckpointError, preview
from tunelab.core.strict_load import ParseProblem, loads_json

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
# bits per element of each dtype the format defines
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
SHOWN = 5  # problems named in one message


def _kind_of(prefix: bytes) -> str | None:
    """What a file that is not safetensors is, from its first bytes."""
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle (torch.save's legacy format), not safetensors"
    if prefix[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save's format: a pickle inside), not safetensors"
    return None


def _tensor_problem(name: str, info: Any, data_bytes: int) -> tuple[str | None, tuple[int, int]]:
    """(problem or None, its [begin, end) offsets) of one header entry."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        return f"tensor {preview(name)}: entry is not {{dtype, shape, data_offsets}}", (0, 0)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        return f"tensor {preview(name)}: unknown dtype {preview(dtype)}", (0, 0)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        return f"tensor {preview(name)}: shape {preview(shape)} is not a list of sizes", (0, 0)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return f"tensor {preview(name)}: data_offsets {preview(offsets)} are not [begin, end]", (
            0,
            0,
        )
    begin, end = offsets
    if end > data_bytes:
        return (
            f"tensor {preview(name)}: data_offsets end at byte {end:,}, past the {data_bytes:,} "
            "bytes of data the file holds (truncated?)",
            (begin, end),
        )
    expected = (math.prod(shape) * DTYPE_BITS[dtype] + 7) // 8
    if end - begin != expected:
        return (
            f"tensor {preview(name)}: shape {shape} of {dtype} needs {expected:,} bytes, its "
            f"offsets span {end - begin:,}",
            (begin, end),
        )
    return None, (begin, end)


def header_problems(prefix: bytes, file_size: int) -> list[str]:
    """Every problem of a safetensors header ([] when it is sound). Pure."""
    kind = _kind_of(prefix)
    if kind is not None:
        return [f"the file is {kind}"]
    if file_size < 8:
        return [f"{file_size} bytes: too short for the 8-byte header length"]
    (size,) = struct.unpack("<Q", prefix[:8])
    if size > MAX_HEADER_BYTES or size > file_size - 8:
        return [
            f"the header claims {size:,} bytes; the file holds {file_size - 8:,} after the "
            "length (truncated, or not safetensors)"
        ]
    raw = prefix[8 : 8 + size]
    if len(raw) < size:
        return [f"only {len(raw):,} of the header's {size:,} bytes were given"]
    try:
        header = loads_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ParseProblem) as exc:
        why = exc.problem if isinstance(exc, ParseProblem) else "not UTF-8"
        return [f"the header is not valid JSON ({why})"]
    if not isinstance(header, dict):
        return [f"the header is a JSON {type(header).__name__}, not an object"]
    meta = header.pop("__metadata__", None)
    problems = []
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        problems.append("__metadata__ is not a mapping of strings")
    data_bytes = file_size - 8 - size
    spans = []
    for name, info in header.items():
        problem, span = _tensor_problem(name, info, data_bytes)
        if problem:
            problems.append(problem)
        else:
            spans.append((span, name))
    spans.sort()
    covered = 0
    for (begin, end), name in spans:
        if begin < covered:
            problems.append(f"tensor {preview(name)}: its bytes overlap another tensor's")
        covered = max(covered, end)
    if not problems and covered != data_bytes:
        problems.append(
            f"the tensors cover {covered:,} of the {data_bytes:,} data bytes (extra or missing data)"
        )
    return problems


def safetensors_problems(path: Path) -> list[str]:
    """The header problems of one file, reading only its header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) == 8 and _kind_of(prefix) is None:
            (n,) = struct.unpack("<Q", prefix)
            if n <= MAX_HEADER_BYTES and n <= size - 8:
                prefix += f.read(n)
    return header_problems(prefix, size)


def require_safetensors(paths: list[Path], what: str) -> None:
    """Raise CheckpointError naming each damaged file of `what` (e.g. 'checkpoint step-4')."""
    bad = [(p, problems) for p in paths if (problems := safetensors_problems(p))]
    if not bad:
        return
    lines = [f"  - {p}: {'; '.join(problems[:SHOWN])}" for p, problems in bad]
    raise CheckpointError(
        f"{what}: {len(bad)} damaged safetensors file(s):\n" + "\n".join(lines),
        hint="the file cannot be loaded; use an earlier checkpoint, or train again",
    )


def tensor_infos(path: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} from the header of a file `safetensors_problems` passed."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = loads_json(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return {name: (info["dtype"], list(info["shape"])) for name, info in header.items()}
