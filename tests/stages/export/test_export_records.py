"""The export's records read typed: a damaged piece of a manifest (even one resealed with its
own sha256) is refused with the located error, naming the file and the field, exit 2."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from tunelab.core.errors import StudyError
from tunelab.stages.export import FORMAT, MANIFEST, limitation_lines, manifest_sha256


def test_a_resealed_manifest_with_a_damaged_piece_is_refused_with_its_place(tmp_path, capsys):
    export = tmp_path / "export"
    export.mkdir()
    truncation = {"train": {"n": "ten", "truncated": 1, "share": 0.1}}
    manifest = {"format": FORMAT, "files": {}, "limitations_detail": {"truncation": truncation}}
    manifest["manifest_sha256"] = manifest_sha256(manifest)
    (export / MANIFEST).write_text(json.dumps(manifest))
    code, out, err = run_cli(capsys, "check-export", export, "--base", tmp_path)
    assert code == 2 and out == "" and "Traceback" not in err
    flat = " ".join(err.split())
    assert MANIFEST in flat and "limitations_detail.truncation.train" in flat
    assert "field 'n' is 'ten'" in flat and "damaged" in flat


def test_limitations_of_a_damaged_detail_name_the_field_not_a_key_error():
    regressed = [{"scope": "category", "item": "sport", "metric": "f1"}]  # no delta
    with pytest.raises(StudyError, match=r"limitations_detail.regressed\[0\]: field 'delta'"):
        limitation_lines({"regressed": regressed})
