"""tunelab.core.worker: a module run in a new process gives back its result, or its error whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tunelab.core.errors import CheckpointError, ModelError
from tunelab.core.worker import Worker

TESTS = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent / "src")])}


def run(do: str, timeout_s: float = 120, **spec):
    with Worker("worker_child") as worker:
        outcome = worker.run({"do": do, **spec}, timeout_s=timeout_s, env=ENV)
        extra = (
            (worker.dir / "extra.txt").read_text() if (worker.dir / "extra.txt").exists() else None
        )
    assert not worker.dir.exists()  # the folder goes with the worker
    return outcome, extra


def test_the_result_and_the_files_the_child_wrote():
    outcome, extra = run("ok", text="written by the child")
    assert outcome.returncode == 0 and extra == "written by the child"
    assert outcome.value(CheckpointError, "in the child", hint="-") == {"answer": 42}


def test_a_tunelab_error_comes_back_as_its_kind_whole():
    from worker_child import LONG

    outcome, _ = run("tunelab")
    assert outcome.returncode == 2  # a TunelabError's exit code
    with pytest.raises(ModelError) as caught:
        outcome.value(CheckpointError, "in the child", hint="the caller's hint")
    assert caught.value.message == f"in the child: {LONG}"  # 5,000 characters, not cut
    assert caught.value.hint == "restore the base folder"


def test_another_exception_comes_back_with_its_traceback():
    outcome, _ = run("python")
    with pytest.raises(CheckpointError) as caught:
        outcome.value(CheckpointError, "in the child", hint="look at the traceback")
    message = caught.value.message
    assert message.startswith("in the child: KeyError: 'no such key'")
    assert "Traceback (most recent call last)" in message and "worker_child.py" in message
    assert caught.value.hint == "look at the traceback"


def test_a_crash_without_a_result_and_a_timeout():
    outcome, _ = run("crash")
    assert outcome.returncode == 3 and not outcome.killed
    with pytest.raises(CheckpointError, match="exit 3 without a result:\ndying without a word"):
        outcome.value(CheckpointError, "in the child", hint="-")
    outcome, _ = run("sleep", timeout_s=3)
    assert outcome.timed_out and outcome.result is None
    with pytest.raises(CheckpointError, match="no result after 3 s"):
        outcome.value(CheckpointError, "in the child", hint="-")
