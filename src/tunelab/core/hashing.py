"""The one home of content hashes: sha256 of bytes, text, files and canonical JSON.

Every record names its inputs by these digests, so two modules hashing "the same thing" must
agree byte for byte; that is why there is one implementation of each form here.

- `sha256_bytes(*parts)`: hex digest of the parts concatenated.
- `sha256_text(text)`: hex digest of the UTF-8 encoding.
- `sha256_json(obj)`: hex digest of the canonical JSON form (sorted keys, no spaces, UTF-8),
  so key order and whitespace never change an id.
- `sha256_file(path)`: hex digest of a file, read in chunks; `sha256_file_cached` remembers it
  per (path, size, mtime) for model weights that several stages hash in one process.
- `stable_u64(key)`: a 64-bit integer from a string, the same on every machine and run (Python's
  `hash` is salted per process), for split buckets and per-example random generators.

The Hub's git blob ids (sha1) belong to the Hub emulation in core/hub_cache.py and MinHash
shingles (blake2b) to data/dedup.py: those are other algorithms for other purposes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "sha256_bytes",
    "sha256_file",
    "sha256_file_cached",
    "sha256_json",
    "sha256_text",
    "stable_u64",
]


def sha256_bytes(*parts: bytes) -> str:
    """Hex sha256 of `parts` concatenated."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    """Hex sha256 of `text` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON form of `obj` (sorted keys, no spaces, UTF-8)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return sha256_text(blob)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of the file at `path`, read `chunk` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# (resolved path, size, mtime_ns) -> sha256; a 538 MB file is hashed once per process.
_FILE_CACHE: dict[tuple[str, int, int], str] = {}


def sha256_file_cached(path: Path) -> str:
    """`sha256_file`, remembered in memory by (resolved path, size, mtime)."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _FILE_CACHE:
        _FILE_CACHE[key] = sha256_file(path)
    return _FILE_CACHE[key]


def stable_u64(key: str) -> int:
    """The first 8 bytes of sha256(`key`) as a big-endian integer: stable across processes."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
