"""The Slurm batch script of a hand-off: `sbatch FILE` runs it as written.

One task a node (`srun --ntasks-per-node=1`), each a torchrun launcher through `tunelab train`;
the nodes meet on the first host of the job (`scontrol show hostnames`). `--requeue` lets
Slurm put the job back in the queue after a node failure or a preemption; the requeued job
runs the same command, which resumes the run. `--open-mode=append` keeps the output of every
start in one file.
"""

from __future__ import annotations

from tunelab.stages.launch.command import device_lines, header, train_line
from tunelab.stages.launch.spec import HandOff


def time_limit(seconds: int) -> str:
    """Slurm's `D-HH:MM:SS`, rounded up to the minute."""
    minutes = -(-seconds // 60)
    days, minutes = divmod(minutes, 24 * 60)
    return f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"


def directives(h: HandOff) -> list[str]:
    out = [
        f"--job-name=tunelab-{h.name}",
        f"--nodes={h.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={h.nproc}" if h.cpu else f"--gpus-per-node={h.gpus_per_node}",
        f"--time={time_limit(h.time_limit_s)}",
        "--requeue",
        "--open-mode=append",
        f"--output={h.study_root / 'launch' / h.name}-%j.out",
    ]
    out += [f"--partition={h.partition}"] if h.partition else []
    out += [f"--account={h.account}"] if h.account else []
    return [f"#SBATCH {d}" for d in out]


def render(h: HandOff) -> str:
    """The script's text."""
    node = train_line(
        h,
        study=str(h.study_root),
        nproc=str(h.nproc),
        nnodes='"$SLURM_NNODES"',
        node_rank='"$SLURM_NODEID"',
        head="$HEAD_NODE",
    )
    quoted = node.replace("'", "'\\''")  # inside bash -c '...'
    gpu = f"# {h.gpus_per_node} x {h.gpu} a node" if not h.cpu else f"# {h.nproc} CPU ranks a node"
    lines = [
        "#!/bin/bash",
        *header(h, "sbatch THIS_FILE   (requeued after a preemption, it resumes the run)"),
        gpu,
        *directives(h),
        "",
        "set -euo pipefail",
        *device_lines(h),
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export HEAD_NODE",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '{quoted}'",
    ]
    return "\n".join(lines) + "\n"
