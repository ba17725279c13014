"""Kill and resume, the fast version of tests/stress/: a tiny Llama run is SIGKILLed 3 times from
the outside (at a random moment after a random step, and once while a checkpoint is being
written) and resumed each time; it must end bit for bit where an uninterrupted run ends, the
ledger must show every killed attempt as interrupted, and no checkpoint may be half-written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "stress"))

import harness  # noqa: E402

from helpers import kill_harness_fixtures  # noqa: E402

STEPS = 12
CHECKPOINT_EVERY = 3


launcher, study_dir = kill_harness_fixtures("kill", steps=STEPS, checkpoint_every=CHECKPOINT_EVERY)


@pytest.fixture(scope="module")
def straight(study_dir, launcher) -> Path:
    """The uninterrupted run (its own process, like the killed ones)."""
    from tunelab.core.study import Study

    proc = launcher.start("train", "--name", "straight", "-s", study_dir, "--json")
    proc.join(600)
    assert proc.exitcode == 0, harness.output(proc)[-3000:]
    (row,) = [r for r in Study.open(study_dir).ledger.list_runs() if r.name == "straight"]
    return study_dir / "records" / "runs" / row.id


@pytest.mark.slow
def test_three_sigkills_then_resume_is_bit_exact(study_dir, launcher, straight):
    from tunelab.core.study import Study

    report = harness.kill_and_resume(
        launcher,
        study_dir,
        steps=STEPS,
        kills=3,
        save_kills={1},
        seed=1,
        step_s=harness.median_step_s(straight),
    )
    assert len(report.kills) == 3 and report.attempts == 4
    assert report.in_save >= 1, report.kills  # the save-aimed kill left a temporary folder
    run_dir = study_dir / "records" / "runs" / report.run_id
    harness.assert_bit_identical(run_dir, straight)
    harness.check_ledger_after_kills(study_dir, report)
    # the resumes removed what the kills left; the finished run holds only complete checkpoints
    assert harness.assert_no_half_checkpoint(run_dir / "checkpoints") == []
    assert (run_dir / "DONE").exists()
    runs = {r.id: r.status for r in Study.open(study_dir).list_runs()}
    assert runs[report.run_id] == "completed" and runs[straight.name] == "completed"
