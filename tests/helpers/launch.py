"""Starting, watching and killing the tunelab a hand-off test launches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def tunelab_env(**extra: str) -> dict[str, str]:
    """The environment of a tunelab a test starts: this interpreter's tunelab first on PATH,
    this source tree first on the import path, CPU ranks of one thread."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
        TUNELAB_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        **extra,
    )
    return env


def run_dir_of(study_root: Path, name: str) -> Path:
    from tunelab.core.study import Study

    rows = [r for r in Study.open(study_root).ledger.list_runs("train") if r.name == name]
    assert len(rows) == 1, f"{len(rows)} runs named {name}"  # never a second run of a name
    return study_root / "records" / "runs" / rows[0].id


def wait_for_checkpoint(study_root: Path, name: str, step: int, timeout: float = 300) -> Path:
    """Wait until the run `name` has finished checkpoint `step`; its run folder."""
    end = time.monotonic() + timeout
    runs = study_root / "records" / "runs"
    while time.monotonic() < end:
        for config in runs.glob("*/config.json"):
            if json.loads(config.read_text()).get("name") != name:
                continue
            if (config.parent / "checkpoints" / f"step-{step:06d}" / "DONE").exists():
                return config.parent
        time.sleep(0.05)
    raise TimeoutError(f"run {name} did not save checkpoint {step} in {timeout:.0f} s")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (the launcher, torchrun and its ranks)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
