"""The long kill test (`make stress`, marker `stress`): one tiny Llama run SIGKILLed 20 times from
the outside and resumed after each kill. 14 kills fall at a random moment after a random step
(in a forward, a backward, an optimizer step, a validation pass, a heartbeat or a checkpoint
write, wherever the moment lands), 6 are aimed at checkpoint writes in progress. The run must
end bit for bit where an uninterrupted run ends (CPU, fp32), the ledger must show the 20 killed
attempts as interrupted, and after every kill each checkpoint under its real name must be
complete with matching sha256s.

Set TUNELAB_STRESS_SEED to replay another schedule; the schedule and timings are printed."""

from __future__ import annotations

import os

import harness
import pytest

from helpers import kill_harness_fixtures

pytestmark = pytest.mark.stress

STEPS = 64
CHECKPOINT_EVERY = 3
KILLS = 20
SAVE_KILLS = {2, 5, 9, 12, 16, 18}


launcher, study_dir = kill_harness_fixtures(
    "stress", steps=STEPS, checkpoint_every=CHECKPOINT_EVERY
)


def test_twenty_sigkills_then_resume_is_bit_exact(study_dir, launcher):
    from tunelab.core.study import Study

    proc = launcher.start("train", "--name", "straight", "-s", study_dir, "--json")
    proc.join(1800)
    assert proc.exitcode == 0, harness.output(proc)[-3000:]
    (row,) = [r for r in Study.open(study_dir).ledger.list_runs() if r.name == "straight"]
    straight = study_dir / "records" / "runs" / row.id
    step_s = harness.median_step_s(straight)

    seed = int(os.environ.get("TUNELAB_STRESS_SEED", "20"))
    report = harness.kill_and_resume(
        launcher,
        study_dir,
        steps=STEPS,
        kills=KILLS,
        save_kills=SAVE_KILLS,
        seed=seed,
        step_s=step_s,
        gap=3,
        timeout_s=900,
    )
    print(
        f"\nseed {seed}: {len(report.kills)} kills over {report.attempts} attempts, "
        f"{report.in_save} inside a checkpoint write, {report.seconds:.0f} s, step {step_s:.3f} s"
    )
    for k in report.kills:
        print(
            f"  attempt {k.attempt:2d}: {k.mode:4s} target step {k.target:2d}, killed at "
            f"step {k.at_step:2d}{', in a checkpoint write' if k.in_save else ''}"
        )
    assert len(report.kills) == KILLS and report.attempts == KILLS + 1
    assert report.in_save >= len(SAVE_KILLS) // 2, report.kills
    run_dir = study_dir / "records" / "runs" / report.run_id
    harness.assert_bit_identical(run_dir, straight)
    harness.check_ledger_after_kills(study_dir, report)
    assert harness.assert_no_half_checkpoint(run_dir / "checkpoints") == []
    assert (run_dir / "DONE").exists()
