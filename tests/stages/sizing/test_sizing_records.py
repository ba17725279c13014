"""The measuring child's spec and results are read as their kinds: a damaged one is refused with
the located error (file, place, field) instead of a KeyError or TypeError deep in a measurement."""

from __future__ import annotations

import json

import pytest

from tunelab.core.errors import StudyError
from tunelab.core.record_smoke import checks_of
from tunelab.core.record_types import Smoke
from tunelab.stages.sizing.measure import result_path
from tunelab.stages.sizing.processes import _final, measure_configurations


def test_a_damaged_child_result_names_its_file_and_field(tmp_path):
    path = result_path(tmp_path, 0)
    path.write_text(
        json.dumps({"label": "config @64", "status": "ok", "measured": {"idle_rss": "x"}})
    )
    with pytest.raises(StudyError) as raised:
        _final(tmp_path, 0)
    assert f"{path}: measured: field 'idle_rss' is 'x', not int" in raised.value.message
    memory = result_path(tmp_path, 1, "memory")
    memory.write_text(json.dumps({"label": "config @64", "status": 3}))
    with pytest.raises(StudyError, match="field 'status' is 3, not a string"):
        _final(tmp_path, 1)


def test_a_spec_of_the_wrong_shape_is_refused_before_a_child_starts():
    spec = {"config": {}, "label": "config @64", "seq_len": "64", "micro_batch": 2}
    with pytest.raises(StudyError) as raised:
        measure_configurations([spec], timeout_s=5)
    assert "configurations[0]: field 'seq_len' is '64', not int" in raised.value.message


def test_a_damaged_smoke_check_names_its_place(tmp_path):
    raw = {"passed": True, "checks": [{"check": "steps ran", "ok": "yes", "detail": "2 of 2"}]}
    smoke = Smoke.of(tmp_path / "smoke.json", raw)
    with pytest.raises(StudyError, match=r"checks\[0\]: field 'ok' is 'yes', not true/false"):
        checks_of(smoke)
