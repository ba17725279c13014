"""The distributed tests' shared pieces: their study, the CLI in a child process, and the run
folders a launch left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tunelab.demo.studies import write_synthetic_email_study

BASE_SETS = ["training.micro_batch_size=2"]  # per rank; the single process takes 4


def write_distributed_study(root: Path, tiny_llama_dir: Path) -> Path:
    """The tiny Llama extraction study the distributed tests train (4 steps, micro 4 x 2,
    checkpoints at 2 and 4), with its data snapshot and registered hypothesis."""
    training = {
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "max_steps": 4,
        "lr": 0.01,
        "eval_every_steps": 2,
        "checkpoint_every_steps": 2,
        "num_threads": 1,
    }
    return write_synthetic_email_study(
        root, "distributed", {"path": str(tiny_llama_dir)}, training=training
    )


def tunelab(*args: object, env: dict[str, str] | None = None, timeout: float = 240):
    """`python -m tunelab ARGS` in a child process, as a user runs it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tunelab", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def only_run_since(root: Path, before: set[str]) -> Path:
    new = sorted(set(os.listdir(root / "records" / "runs")) - before)
    assert len(new) == 1, new
    return root / "records" / "runs" / new[0]


def runs(root: Path) -> set[str]:
    folder = root / "records" / "runs"
    return set(os.listdir(folder)) if folder.exists() else set()
