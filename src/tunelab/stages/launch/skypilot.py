"""The SkyPilot task file of a hand-off: `sky launch` (a cluster) or `sky jobs launch` (a
managed job, recovered on a new node after a spot preemption) runs it as written.

SkyPilot runs `setup` once on every node it provisions and `run` on every node of the job,
with SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one a line, the head first), SKYPILOT_NUM_NODES and
SKYPILOT_NUM_GPUS_PER_NODE set. The study folder reaches the nodes as the task's `workdir`
(each node gets its own copy) or, with a bucket, as a mount that outlives a preempted node.
"""

from __future__ import annotations

from typing import Any

import yaml

from tunelab.stages.launch.command import device_lines, header, train_line
from tunelab.stages.launch.spec import HandOff

BUCKET_MOUNT = "/tunelab/study"


def task(h: HandOff) -> dict[str, Any]:
    """The task as SkyPilot's YAML schema spells it."""
    resources: dict[str, Any] = (
        {"cpus": f"{h.nproc}+"} if h.cpu else {"accelerators": f"{h.accelerator}:{h.gpus_per_node}"}
    )
    resources["disk_size"] = h.disk_gb
    if h.spot:
        resources["use_spot"] = True
    out: dict[str, Any] = {"name": f"tunelab-{h.name}", "num_nodes": h.nodes}
    out["resources"] = resources
    mounts: dict[str, Any] = {}
    if h.bucket:
        # cached mode writes through a local cache: records, SQLite ledger and checkpoints
        mounts[BUCKET_MOUNT] = {"source": h.bucket, "mode": "MOUNT_CACHED"}
    else:
        out["workdir"] = str(h.study_root)
    if h.model_mount is not None:
        mounts[str(h.model_mount)] = str(h.model_mount)  # study.yaml names it by this path
    if mounts:
        out["file_mounts"] = mounts
    out["setup"] = _lines(
        "set -euo pipefail",
        h.torch.comment(),
        h.torch.pip_line(),
        f'pip install "{h.install}"',
    )
    out["run"] = run_script(h)
    return out


def run_script(h: HandOff) -> str:
    """The `run:` section: torchrun through tunelab, the head node as the rendezvous."""
    study = BUCKET_MOUNT if h.bucket else "."
    nproc = str(h.nproc) if h.cpu else '"$SKYPILOT_NUM_GPUS_PER_NODE"'
    line = train_line(
        h,
        study=study,
        nproc=nproc,
        nnodes='"$SKYPILOT_NUM_NODES"',
        node_rank='"$SKYPILOT_NODE_RANK"',
        head="$HEAD_IP",
    )
    return _lines(
        "set -euo pipefail",
        *device_lines(h),
        'HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
        line,
    )


def render(h: HandOff) -> str:
    """The task file's text: a comment header, then the YAML."""
    how = "sky jobs launch THIS_FILE   (or: sky launch -c CLUSTER THIS_FILE)"
    body = yaml.dump(task(h), Dumper=_Dumper, sort_keys=False, width=100)
    return "\n".join(header(h, how)) + "\n" + body


def _lines(*lines: str) -> str:
    return "\n".join(lines) + "\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks (`|`), so the scripts read as written."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
