"""core/hashing: the digests every record names its inputs by, pinned to known values."""

from __future__ import annotations

import hashlib

from tunelab.core.hashing import (
    sha256_bytes,
    sha256_file,
    sha256_file_cached,
    sha256_json,
    sha256_text,
    stable_u64,
)


def test_json_digest_ignores_key_order_and_spacing():
    a = sha256_json({"b": [1, 2], "a": "é"})
    assert a == sha256_json({"a": "é", "b": [1, 2]})
    # canonical form: sorted keys, no spaces, UTF-8 (not \u escapes)
    assert a == hashlib.sha256('{"a":"é","b":[1,2]}'.encode()).hexdigest()


def test_bytes_text_and_file_agree(tmp_path):
    data = b"tunelab\n" * 100_000
    path = tmp_path / "blob"
    path.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert sha256_bytes(data) == sha256_text(data.decode()) == want
    assert sha256_bytes(data[:7], data[7:]) == want
    assert sha256_file(path, chunk=4096) == want
    assert sha256_file_cached(path) == want


def test_cached_file_digest_follows_a_rewrite(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"one")
    first = sha256_file_cached(path)
    path.write_bytes(b"second version")  # another size: another cache key
    assert sha256_file_cached(path) == sha256_bytes(b"second version") != first


def test_stable_u64_is_fixed():
    # split buckets and augmentation generators depend on this value never changing
    assert stable_u64("tunelab:split:0:x") == int.from_bytes(
        hashlib.sha256(b"tunelab:split:0:x").digest()[:8], "big"
    )
