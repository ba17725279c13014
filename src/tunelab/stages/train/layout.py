"""Where a run's checkpoints are: `checkpoints/step-XXXXXX/` (complete when DONE is in it) and
`checkpoints/final`, a link to the last one. Without torch, so that the commands that only look
for a checkpoint (verify's parent, export) do not pay its import."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from tunelab.core.errors import CheckpointError

_STEP_RE = re.compile(r"^step-(\d{6,})$")
FINAL = "final"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with DONE), oldest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and not p.is_symlink() and (p / "DONE").exists():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def incomplete_checkpoints(root: Path, latest: Path | None) -> list[Path]:
    """step-XXXXXX folders after `latest` (the newest complete one) without their DONE marker:
    a resume goes back past them, and says so."""
    after = int(_STEP_RE.match(latest.name).group(1)) if latest is not None else -1
    out = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and int(m.group(1)) > after and not (p / "DONE").exists():
                out.append(p)
    return out


def final_checkpoint(root: Path) -> Path | None:
    """The checkpoint `final` points at (or `final` itself, a folder where a copy of the study
    did not keep the link); a link leading out of this run's checkpoints (an edited run folder)
    is refused rather than followed."""
    link = root / FINAL
    if not link.exists():
        return None
    target = link.resolve()
    if target.parent != root.resolve() or not (_STEP_RE.match(target.name) or target.name == FINAL):
        raise CheckpointError(
            f"{link} points at {target}, which is not a checkpoint of this run",
            hint="the run folder was edited; point it back at its last step-XXXXXX folder, or "
            "start a new run",
        )
    return target


def mark_final(root: Path, step: int) -> None:
    """Point checkpoints/final at step-XXXXXX (a relative symlink, replaced atomically)."""
    tmp = root / f".{FINAL}.tmp-{uuid.uuid4().hex[:8]}"
    os.symlink(step_dir_name(step), tmp)
    os.replace(tmp, root / FINAL)
