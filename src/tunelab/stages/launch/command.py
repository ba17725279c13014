"""The command every node of a hand-off runs: one line, the same on every start of the job.

`tunelab train --name NAME --resume-if-exists` starts the run NAME, or resumes it from its
latest complete checkpoint when a preemption, a requeue or a kill stopped it, or reports it
completed: never a second run of the name. Each engine fills in its own node rank, node count,
ranks a node and the first node's address (`train_line`).
"""

from __future__ import annotations

import shlex

from tunelab.stages.launch.spec import HandOff


def train_line(
    h: HandOff, *, study: str, nproc: str, nnodes: str, node_rank: str, head: str
) -> str:
    """`exec tunelab train ...` for a shell: `study`, `nproc`, `nnodes`, `node_rank` and `head`
    (the first node's address) are shell words, variables of the engine among them. `exec`
    hands the engine's SIGTERM to tunelab, which records the run interrupted."""
    words = [
        "exec tunelab train",
        f"--study {study}",
        f"--name {h.name} --resume-if-exists",
        f"--strategy {h.strategy} --nproc {nproc}",
        f"--nnodes {nnodes} --node-rank {node_rank}",
        f'--rdzv-endpoint "{head}:{h.port}"',
    ]
    if h.why:
        words.append(f"--other-platform --why {shlex.quote(h.why)}")
    return " \\\n  ".join(words)


def device_lines(h: HandOff) -> list[str]:
    """Shell lines before the command: CPU ranks are asked for explicitly (gloo)."""
    return ["export TUNELAB_DEVICE=cpu"] if h.cpu else []


def header(h: HandOff, how: str) -> list[str]:
    """The comment lines at the top of a written file: where it came from and how to run it."""
    return [
        f"# tunelab hand-off of run {h.name!r}: study {h.study_root}, plan {h.plan_id}",
        f"# {how}",
        "# Started again after a preemption, a requeue or a kill, it resumes the run of this",
        "# name from its latest checkpoint (the same result as an uninterrupted run).",
    ]
