"""Kill/resume harness shared by the fast kill test (tests/stages/train/test_kill_resume.py), the stress test
(tests/stress/test_kill_stress.py) and the concurrency test.

Every `tunelab` command runs in its own process, started from a fork server that imported
torch, transformers, peft and tunelab once (so an attempt costs well under a second instead of
the 5-20 s of a cold `python -m tunelab`). The processes are real: the test kills them with
`os.kill(pid, SIGKILL)` at moments it picks, and they never get to clean up.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "tokens", "loss_tokens", "epoch", "val_loss")
PRELOAD = ["torch", "transformers", "peft", "safetensors", "harness_child"]


# ------------------------------------------------------------------ the study


def write_study(root: Path, model_dir: Path, *, steps: int, checkpoint_every: int) -> Path:
    """A registered extraction study (sender, subject) on the tiny Llama, with its snapshot."""
    from helpers import write_email_study

    return write_email_study(
        root,
        model_dir,
        "kill-test",
        max_steps=steps,
        eval_every_steps=5,
        checkpoint_every_steps=checkpoint_every,
    )


# ------------------------------------------------------------------ processes


class Launcher:
    """Starts `tunelab ARGS` in fresh processes forked from a warm fork server."""

    def __init__(self, logs: Path):
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.count = 0

    def start(self, *args: str, env: dict[str, str] | None = None) -> Any:
        import harness_child

        self.count += 1
        log = self.logs / f"{self.count:03d}-{args[0]}.log"
        proc = self.ctx.Process(
            target=harness_child.run_cli, args=([str(a) for a in args], str(log), env or {})
        )
        proc.start()
        proc.log = log  # type: ignore[attr-defined]
        return proc


def output(proc: Any) -> str:
    return Path(proc.log).read_text(errors="replace")


# ------------------------------------------------------------------ observing a run


def last_step(run_dir: Path) -> int:
    """The last step in metrics.jsonl (0 when none)."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def saving(ckpt_root: Path) -> list[str]:
    """Checkpoint folders being written right now (their temporary names)."""
    try:
        return [n for n in os.listdir(ckpt_root) if n.startswith(".step-") and ".tmp-" in n]
    except FileNotFoundError:
        return []


def assert_no_half_checkpoint(ckpt_root: Path) -> list[str]:
    """Every checkpoint under its real name is complete and matches its sha256s; returns the
    names of the temporary (never used) folders a kill left behind."""
    from tunelab.stages.train import checkpoint as ckpt

    if not ckpt_root.exists():
        return []
    leftovers = []
    for p in ckpt_root.iterdir():
        if p.name.startswith("."):
            leftovers.append(p.name)
            continue
        if p.name == ckpt.FINAL:
            assert p.is_symlink() and (p.resolve() / "DONE").exists(), p
            continue
        assert ckpt._STEP_RE.match(p.name), f"unexpected entry {p}"
        state = ckpt.read_checkpoint_state(p, verify=True)  # raises on a missing/changed file
        assert state.step == int(p.name.split("-")[1])
    return leftovers


def curve(run_dir: Path) -> list[dict[str, Any]]:
    from tunelab.core.records import read_jsonl

    return [{k: r.get(k) for k in CURVE_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


def final_tensors(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(
        str(run_dir / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")
    )


def assert_bit_identical(run_dir: Path, reference_dir: Path) -> None:
    import torch

    assert curve(run_dir) == curve(reference_dir)  # exact floats: loss, lr, grad norm, val loss
    a, b = final_tensors(run_dir), final_tensors(reference_dir)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].dtype == torch.float32
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------ the kill loop


@dataclass
class Kill:
    attempt: int
    mode: str  # "step": at a random moment around a target step; "save": while a checkpoint is written
    target: int
    at_step: int  # last step in metrics.jsonl when the kill was sent
    in_save: bool  # a temporary checkpoint folder was left behind
    leftovers: list[str] = field(default_factory=list)


@dataclass
class KillReport:
    run_id: str
    kills: list[Kill]
    attempts: int
    seconds: float

    @property
    def in_save(self) -> int:
        return sum(k.in_save for k in self.kills)


def _wait_until(pred, proc: Any, timeout_s: float, poll_s: float) -> bool:
    """Poll `pred` until true; False if the process ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        if not proc.is_alive():
            return pred()
        time.sleep(poll_s)
    raise TimeoutError(f"nothing happened in {timeout_s} s; log: {output(proc)[-2000:]}")


def _running_row(study_dir: Path, run_id: str | None, pid: int, found: list[str]) -> bool:
    """True once process `pid` runs the run `run_id` (or any training run); its id goes into
    `found`. Reads the ledger read-only, so polling never takes its write lock."""
    db = sqlite3.connect(f"file:{study_dir / 'records' / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT id, pid, status FROM runs WHERE kind = 'train'").fetchall()
    finally:
        db.close()
    for rid, rpid, status in rows:
        if rpid == pid and status == "running" and run_id in (None, rid):
            found.append(rid)
            return True
    return False


def _past_step(run_dir: Path, step: int) -> bool:
    return last_step(run_dir) >= step


def median_step_s(run_dir: Path) -> float:
    """The median seconds of a run's steps (metrics.jsonl)."""
    from tunelab.core.records import read_jsonl

    times = sorted(r["seconds"] for r in read_jsonl(run_dir / "metrics.jsonl") if "seconds" in r)
    return times[len(times) // 2]


def kill_targets(rng: random.Random, steps: int, kills: int, gap: int) -> list[int]:
    """`kills` increasing steps in [1, steps - 2], at least `gap` apart, at random (the last
    step and its final checkpoint stay ahead, so a kill never comes after the run ended)."""
    slack = steps - 2 - gap * (kills - 1) - 1
    assert slack >= 0, "too many kills for the run's length"
    cuts = sorted(rng.randint(0, slack) for _ in range(kills))
    return [1 + c + gap * i for i, c in enumerate(cuts)]


def kill_and_resume(
    launcher: Launcher,
    study_dir: Path,
    *,
    steps: int,
    kills: int,
    save_kills: set[int],
    seed: int,
    step_s: float,
    gap: int = 2,
    name: str = "killed",
    timeout_s: float = 300.0,
) -> KillReport:
    """`tunelab train`, then SIGKILL and `tunelab resume` until `kills` kills happened and the
    run completed. Kill i (0-based) is aimed at a random moment after a random target step, or,
    when i is in `save_kills`, at the first checkpoint write after its target step. After every
    kill the checkpoints are checked (none half-written) and the ledger must say interrupted."""
    from tunelab.core.study import Study

    rng = random.Random(seed)
    targets = kill_targets(rng, steps, kills, gap)
    t0 = time.monotonic()
    run_id: str | None = None
    done: list[Kill] = []
    attempt = 0
    while True:
        attempt += 1
        args = ("train", "--name", name) if run_id is None else ("resume", run_id)
        proc = launcher.start(*args, "-s", study_dir, "--json")
        if len(done) == kills:  # the last attempt runs to the end
            proc.join(timeout_s)
            assert proc.exitcode == 0, output(proc)[-3000:]
            break
        i = len(done)
        target = targets[i]
        found: list[str] = []
        started = partial(_running_row, study_dir, run_id, proc.pid, found)
        assert _wait_until(started, proc, timeout_s, 0.01), output(proc)[-3000:]
        run_id = found[0]
        run_dir = study_dir / "records" / "runs" / run_id
        ckpt_root = run_dir / "checkpoints"
        mode = "save" if i in save_kills else "step"
        # the attempt has loaded its checkpoint and trained past the target
        past = partial(_past_step, run_dir, target)
        reached = _wait_until(past, proc, timeout_s, 0.005)
        assert reached, f"attempt {attempt} ended before step {target}: {output(proc)[-3000:]}"
        if mode == "save":
            _wait_until(partial(saving, ckpt_root), proc, timeout_s, 0.0005)
        else:
            time.sleep(rng.uniform(0.0, step_s))
        at_step = last_step(run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL, (proc.exitcode, output(proc)[-3000:])
        leftovers = assert_no_half_checkpoint(ckpt_root)
        in_save = any(n.startswith(".step-") and ".tmp-" in n for n in leftovers)
        done.append(Kill(attempt, mode, target, at_step, in_save, leftovers))
        study = Study.open(study_dir)
        assert run_id in study.reconcile()  # the process is gone: interrupted
        assert study.ledger.get_run(run_id).status == "interrupted"
    return KillReport(run_id, done, attempt, time.monotonic() - t0)


def check_ledger_after_kills(study_dir: Path, report: KillReport) -> None:
    """The ledger shows every killed attempt as interrupted, then the completion."""
    from tunelab.core.study import Study

    study = Study.open(study_dir)
    row = study.ledger.get_run(report.run_id)
    assert row.status == "completed" and row.finished_at
    kinds = [e.kind for e in study.ledger.events(report.run_id)]
    assert kinds.count("status:interrupted") == len(report.kills), kinds
    assert kinds.count("status:running") == len(report.kills)  # one per resume
    assert kinds[-1] == "status:completed" or "status:completed" in kinds
    # interrupted always between two attempts: running (resume) follows each interrupted
    flow = [k for k in kinds if k.startswith("status:")]
    assert flow == ["status:interrupted", "status:running"] * len(report.kills) + [
        "status:completed"
    ], flow
