"""The study the hand-off tests launch: a tiny Llama LoRA run of 2 CPU ranks (gloo, DDP),
planned for 2 x H100-SXM a node, and its uninterrupted run, the reference of every killed one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import run_dir_of, tunelab_env

STEPS = 16
CHECKPOINT_EVERY = 2


@pytest.fixture(scope="session")
def launch_study(tmp_path_factory, tiny_llama_dir) -> Path:
    """Registered, its data snapshot built, and a GPU plan recorded (what `tunelab launch`
    reads)."""
    from helpers import write_email_study
    from tunelab.core.study import Study
    from tunelab.stages.plan.stage import run as make_plan

    root = write_email_study(
        tmp_path_factory.mktemp("launch") / "study",
        tiny_llama_dir,
        "launch",
        max_steps=STEPS,
        eval_every_steps=0,
        checkpoint_every_steps=CHECKPOINT_EVERY,
    )
    make_plan(Study.open(root), gpu="H100-SXM", gpus=2, days=3)
    return root


@pytest.fixture(scope="session")
def straight_run(launch_study) -> Path:
    """`tunelab train --nproc 2 --strategy ddp` to its end, never stopped."""
    done = subprocess.run(
        [sys.executable, "-m", "tunelab", "train", "-s", str(launch_study), "--name", "straight",
         "--nproc", "2", "--strategy", "ddp", "--json"],
        env=tunelab_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir_of(launch_study, "straight")
