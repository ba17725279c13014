"""The safetensors header check (pure) and where it runs before a load: a checkpoint whose
hashes were rewritten over a damaged file is named by `tunelab verify` without a fresh process."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import save_file

from tunelab.core.errors import CheckpointError
from tunelab.core.safetensors_header import header_problems, require_safetensors


@pytest.fixture
def weights(tmp_path) -> bytes:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, str(path))
    return path.read_bytes()


def _edit(data: bytes, fn) -> bytes:
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    fn(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + size :]


def test_a_sound_file_has_no_problem(weights):
    assert header_problems(weights, len(weights)) == []


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: d[: len(d) - 3], "past the"),
        (lambda d: d[:20], "the header claims"),
        (lambda d: b"\xff" * 8 + d[8:], "the header claims"),
        (lambda d: d[:8] + b"<<<<" + d[12:], "not valid JSON"),
        (lambda d: pickle.dumps({"a": 1}), "Python pickle"),
        (lambda d: b"PK\x03\x04" + d[4:], "zip archive"),
        (lambda d: _edit(d, lambda h: h["a"].update(shape=[3, 3])), "needs 36 bytes"),
        (lambda d: _edit(d, lambda h: h["a"].update(dtype="F33")), "unknown dtype"),
        (lambda d: _edit(d, lambda h: h["b"].update(data_offsets=[0, 8])), "overlap"),
        (lambda d: d + b"\x00" * 4, "extra or missing data"),
    ],
)
def test_each_damage_is_named(weights, damage, expected):
    data = damage(weights)
    problems = header_problems(data, len(data))
    assert problems and any(expected in p for p in problems), problems


def test_require_names_the_file(weights, tmp_path):
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    good.write_bytes(weights)
    bad.write_bytes(weights[:-3])
    require_safetensors([good], "checkpoint x")
    with pytest.raises(
        CheckpointError, match=r"(?s)checkpoint x: 1 damaged.*bad\.safetensors.*past the"
    ):
        require_safetensors([good, bad], "checkpoint x")


def test_verify_names_a_resealed_damaged_checkpoint(weights, tmp_path):
    from tunelab.core.hashing import sha256_file
    from tunelab.stages.verify.stage import check_checkpoint_files

    ckpt = tmp_path / "step-000004"
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / "adapter" / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    files = {"adapter/adapter_model.safetensors": ""}
    files = {n: sha256_file(ckpt / n) for n in files}  # hashes rewritten to match
    (ckpt / "state.json").write_text(json.dumps({"step": 4, "files": files}))
    (ckpt / "DONE").write_text("")
    result = check_checkpoint_files(ckpt)
    assert not result["ok"] and not result["changed"] and not result["missing"]
    assert "adapter/adapter_model.safetensors" in result["damaged"]
