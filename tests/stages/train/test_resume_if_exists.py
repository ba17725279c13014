"""`tunelab train --name NAME --resume-if-exists`: one command, run again after every kill,
starts the run, resumes it, and then reports it completed; never a second run of that name.

Each command runs in its own process (the kill harness's fork server); the first is SIGKILLed
after step 3 (`TUNELAB_TEST_KILL_AT`), the second resumes it to the bit-identical result of an
uninterrupted run, the third finds it completed and changes nothing."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "stress"))

import harness  # noqa: E402

from helpers import kill_harness_fixtures  # noqa: E402

launcher, study_dir = kill_harness_fixtures("again", steps=6, checkpoint_every=2)


def tunelab(launcher, *args: str, env: dict[str, str] | None = None):
    proc = launcher.start(*args, env=env)
    proc.join(300)
    return proc


def summary(proc) -> dict:
    """The --json summary: the last JSON object of the log that starts a line."""
    text = harness.output(proc)
    start = max(i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n"))
    return json.JSONDecoder().raw_decode(text[start:])[0]


@pytest.mark.slow
def test_the_same_command_starts_resumes_then_reports_completed(launcher, study_dir):
    from tunelab.core.study import Study

    command = ("train", "-s", study_dir, "--name", "job", "--resume-if-exists", "--json")
    straight = tunelab(launcher, "train", "-s", study_dir, "--name", "straight", "--json")
    assert straight.exitcode == 0, harness.output(straight)[-3000:]

    killed = tunelab(launcher, *command, env={"TUNELAB_TEST_KILL_AT": "step:3"})
    assert killed.exitcode == -signal.SIGKILL, harness.output(killed)[-3000:]
    again = tunelab(launcher, *command)
    assert again.exitcode == 0, harness.output(again)[-3000:]
    resumed = summary(again)
    assert resumed["action"] == "resumed" and resumed["status"] == "completed"
    run_dir = Path(resumed["record"])
    harness.assert_bit_identical(run_dir, Path(summary(straight)["record"]))
    kinds = [e.kind for e in Study.open(study_dir).ledger.events(run_dir.name)]
    assert kinds.count("status:interrupted") == 1 and kinds[-1] == "status:completed"

    done_at = (run_dir / "DONE").stat().st_mtime_ns
    third = tunelab(launcher, *command)
    assert third.exitcode == 0, harness.output(third)[-3000:]
    assert summary(third)["action"] == "completed" and summary(third)["run_id"] == run_dir.name
    assert (run_dir / "DONE").stat().st_mtime_ns == done_at  # nothing trained or rewritten
    names = [r.name for r in Study.open(study_dir).list_runs("train")]
    assert sorted(names) == ["job", "straight"]  # never a second run of the name

    # without --name there is nothing to find: refused before any run exists
    bare = tunelab(launcher, "train", "-s", study_dir, "--resume-if-exists")
    assert bare.exitcode == 2 and "--resume-if-exists needs --name" in harness.output(bare)
    # and a taken name without the flag is still refused
    taken = tunelab(launcher, "train", "-s", study_dir, "--name", "job")
    assert taken.exitcode == 2 and "is taken by train run" in harness.output(taken)
