"""The launch folder: what the ranks of a distributed run leave for the launcher.

The launcher (`tunelab.stages.train.launch`) gives every rank a folder (`TUNELAB_LAUNCH_DIR`). Rank 0
leaves `run.json` naming the run it created; a rank that fails leaves `rank-<k>.json` (its
exception and traceback), which the launcher copies into the run's `ranks/` folder and names in
the run's status.

`report_rank_failure`, `announce_run`, `announced_run`, `read_rank_records`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunelab.core.env import under_torchrun

LAUNCH_DIR_ENV = "TUNELAB_LAUNCH_DIR"


def fail_for_test(rank: int) -> None:
    """Only for the test suite: TUNELAB_TEST_FAIL_RANK=k makes rank k raise when wrapping."""
    if os.environ.get("TUNELAB_TEST_FAIL_RANK") == str(rank):
        raise RuntimeError(f"failure injected on rank {rank} for the test")


def launch_dir() -> Path | None:
    value = os.environ.get(LAUNCH_DIR_ENV)
    return Path(value) if value else None


def write_rank_failure(exc: BaseException) -> Path | None:
    """Leave `rank-<k>.json` (exception and traceback) in the launch folder, for the launcher.

    An interruption (SIGINT/SIGTERM) is recorded with kind "interrupted", not as a failure.
    """
    folder = launch_dir()
    if folder is None or not under_torchrun():
        return None
    rank = int(os.environ["RANK"])
    interrupted = isinstance(exc, KeyboardInterrupt) or getattr(exc, "exit_code", 0) >= 128
    cause = exc.__cause__ or exc  # RunFailed wraps the exception that stopped the run
    record = {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "kind": "interrupted" if interrupted else "failed",
        "error": f"{type(cause).__name__}: {getattr(cause, 'message', None) or cause}",
        "hint": getattr(exc, "hint", None),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def report_rank_failure() -> Iterator[None]:
    """Around a rank's work: an exception leaves its record for the launcher, then propagates."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            write_rank_failure(exc)
        raise


def announce_run(run_id: str, run_dir: Path | None) -> None:
    """Tell the launcher which run this launch trains (`run.json` in the launch dir): rank 0
    names the run's folder; a node without rank 0 names the run only (`run_dir` None: its
    records are node 0's)."""
    folder = launch_dir()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "run.json.tmp"
    where = str(run_dir) if run_dir is not None else None
    tmp.write_text(json.dumps({"run_id": run_id, "run_dir": where}))
    os.replace(tmp, folder / "run.json")


def announced_run(folder: Path) -> dict[str, Any] | None:
    """`run.json` of a launch folder ({run_id, run_dir}; run_dir None on a node without rank 0),
    None when no rank left one."""
    path = folder / "run.json"
    return json.loads(path.read_text()) if path.exists() else None


def read_rank_records(folder: Path) -> list[dict[str, Any]]:
    """The `rank-<k>.json` records of a launch folder, in rank order."""
    out = []
    for p in sorted(folder.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            out.append({"rank": int(p.stem.split("-")[1]), "error": f"unreadable record {p.name}"})
    return out
