"""The process group a distributed run joins: torchrun prepared it, every rank joins it.

nccl on CUDA (RCCL on ROCm answers to the same name), gloo on CPU; a collective waits
`TUNELAB_DIST_TIMEOUT_S` (default 1800 s) for a missing rank before failing.

`init_process_group`, `destroy_process_group`, and the backend with its version.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from tunelab.core.env import under_torchrun
from tunelab.core.errors import RunError

# How long a collective waits for a missing rank before failing (torchrun usually stops the
# other ranks first, when one exits with an error).
TIMEOUT_S = float(os.environ.get("TUNELAB_DIST_TIMEOUT_S", "1800"))
# glibc's mallopt parameters, and the size from which a rank's host blocks are mapped on their
# own (and unmapped when freed). "default" in TUNELAB_RANK_MALLOC leaves glibc's own policy.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 256 * 1024
MALLOC_ENV = "TUNELAB_RANK_MALLOC"


def return_freed_blocks() -> bool:
    """Make glibc hand freed blocks of 256 KiB and more back to the system at once, in this rank.

    glibc raises its mmap threshold to the size of any mapped block freed (up to 32 MiB): after
    FSDP frees its first all-gathered block, the next ones come from the heap arenas, which keep
    what is freed. Over the forward and backward of a step a rank's resident memory grows by
    several blocks' worth per step; a fixed threshold keeps it at what is live. Returns whether
    the setting was applied (glibc only)."""
    if not sys.platform.startswith("linux") or os.environ.get(MALLOC_ENV) == "default":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and other C libraries: their own policy
        return False
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES)
    )


def pick_backend(device: torch.device) -> str:
    """nccl on CUDA (RCCL on ROCm answers to the same name), gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def backend_version(backend: str) -> dict[str, Any]:
    """The communication library and its version: gloo (bundled with torch), NCCL or RCCL."""
    if backend == "nccl":
        name = "rccl" if getattr(torch.version, "hip", None) else "nccl"
        try:
            v = torch.cuda.nccl.version()
            version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - builds without NCCL
            version = None
        return {"library": name, "version": version}
    # gloo has no version of its own; it is compiled into torch.
    return {"library": "gloo", "version": f"bundled with torch {torch.__version__}"}


def init_process_group() -> tuple[int, int, int, torch.device, str]:
    """Join the process group torchrun prepared: (rank, world_size, local_rank, device, backend).

    Raises RunError outside torchrun.
    """
    if not under_torchrun():
        raise RunError(
            "a distributed strategy needs the processes torchrun starts",
            hint="run `tunelab train --nproc N --strategy ddp|fsdp` (it calls torchrun)",
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = pick_backend(device)
    return_freed_blocks()
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=TIMEOUT_S)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    return rank, world, local_rank, device, backend


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
