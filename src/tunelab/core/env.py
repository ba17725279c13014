"""Environment capture: enough to tell runs on different platforms apart.

The same dictionary is printed by `tunelab env` and saved as env.json with every run. CUDA and
ROCm fields are present (null) on CPU so that records have one shape everywhere.

- `capture_env() -> dict`: saved as env.json in every run; `compute_device` says where tunelab
  computes.
- `device_kind() -> "cuda" | "cpu"`: CUDA when torch sees it; `TUNELAB_DEVICE=cpu|cuda` decides,
  checked by `requested_device()` before every CLI command (a bad value is a ConfigError).
  `tunelab.lib.models.compute_device()` is the torch device with its index.
- `cpu_share(cpu_s, seconds, threads, device)`: process CPU seconds over wall seconds x threads
  on the CPU, else None; below `BUSY_CPU_SHARE` (0.8) the cores were shared.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "safetensors",
    "tokenizers",
    "accelerate",
    "datasets",
    "numpy",
    "pydantic",
    "tunelab",
)


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> dict[str, Any] | None:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return Path("/sys/module/amdgpu/version").read_text().strip()
    except OSError:
        return None


def _attention_kernels(torch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"sdpa": hasattr(torch.nn.functional, "scaled_dot_product_attention")}
    if torch.cuda.is_available():
        b = torch.backends.cuda
        out.update(
            flash_sdp=b.flash_sdp_enabled(),
            mem_efficient_sdp=b.mem_efficient_sdp_enabled(),
            math_sdp=b.math_sdp_enabled(),
        )
    else:
        out.update(flash_sdp=None, mem_efficient_sdp=None, math_sdp=True)
    out["flash_attn_package"] = _version("flash-attn") or _version("flash_attn")
    return out


def capture_env() -> dict[str, Any]:
    import torch

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_bytes": p.total_memory,
                    "capability": f"{p.major}.{p.minor}"
                    if not hip
                    else getattr(p, "gcnArchName", None),
                }
            )
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - NCCL absent in some builds
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "os": {
            "system": platform.system(),
            "release": platform.release(),
            "platform": platform.platform(),
        },
        "cpu": {
            "name": _cpu_name(),
            "machine": platform.machine(),
            "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "torch": torch.__version__,
        "backend": "rocm" if hip else ("cuda" if torch.cuda.is_available() else "cpu"),
        "compute_device": device_kind(),  # where tunelab computes (TUNELAB_DEVICE may say cpu)
        "cuda": cuda,
        "rocm": hip,
        "cudnn": cudnn,
        "nccl": nccl if not hip else None,
        "rccl": nccl if hip else None,
        "driver": _driver_version() if torch.cuda.is_available() else None,
        "gpus": gpus,
        "bf16_supported": bf16 or (not torch.cuda.is_available() and None),
        "attention": _attention_kernels(torch),
        "distributed": {
            "available": torch.distributed.is_available(),
            "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
            "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        },
        "packages": {p: _version(p) for p in PACKAGES},
        "extensions": {p: _version(p) for p in EXTENSIONS},
        "tunelab_git": _git_commit(),
    }


# kernels and quantizers whose builds are tied to a GPU, a backend and a torch
EXTENSIONS = ("flash-attn", "bitsandbytes", "liger-kernel")


def platform_of(env: dict[str, Any]) -> dict[str, Any]:
    """The fields of an env.json that make a platform: what a smoke and a baseline that passed
    on one platform say nothing about on another (backend, device, torch, CUDA/ROCm, driver,
    transformers, peft, the extensions installed). Pure."""
    packages = env.get("packages") or {}
    return {
        "backend": env.get("backend"),
        "compute_device": env.get("compute_device", env.get("backend")),
        "devices": sorted(g.get("name") or "?" for g in env.get("gpus") or []),
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "rocm": env.get("rocm"),
        "driver": env.get("driver"),
        "transformers": packages.get("transformers"),
        "peft": packages.get("peft"),
        "extensions": {k: v for k, v in (env.get("extensions") or {}).items() if v},
    }


def describe_platform(p: dict[str, Any]) -> str:
    """One line: 'cpu, torch 2.13.0, transformers 5.24, peft 0.21.2' (GPUs, CUDA, driver and
    extensions when present)."""
    parts = [p["compute_device"] or "?"] + list(p["devices"])
    for key in ("torch", "cuda", "rocm", "driver", "transformers", "peft"):
        if p.get(key):
            parts.append(f"{key} {p[key]}")
    parts += [f"{k} {v}" for k, v in sorted(p.get("extensions", {}).items())]
    return ", ".join(parts)


DEVICE_ENV = "TUNELAB_DEVICE"


def requested_device() -> str | None:
    """`TUNELAB_DEVICE` checked: "cpu" or "cuda", None when unset (CUDA when present). The CLI
    checks it before any command runs, so a typo stops before anything is recorded."""
    from tunelab.core.errors import ConfigError

    wanted = os.environ.get(DEVICE_ENV, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ConfigError(
            f"{DEVICE_ENV}={wanted!r} is not a device tunelab knows",
            hint=f"set {DEVICE_ENV} to cpu or cuda, or unset it to use CUDA when present",
        )
    return wanted or None


def device_kind() -> str:
    """Where tunelab trains and evaluates: "cuda" when torch sees a GPU, else "cpu";
    `TUNELAB_DEVICE` decides instead when set."""
    import torch

    from tunelab.core.errors import ConfigError

    wanted = requested_device()
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{DEVICE_ENV}=cuda but torch {torch.__version__} sees no CUDA device",
            hint=f"unset {DEVICE_ENV} or install a CUDA build of torch",
        )
    if wanted == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


# Below this share of its threads' CPU time, work on the CPU (an evaluation, timed training
# steps) shared the cores with another process (about 0.95 on quiet cores).
BUSY_CPU_SHARE = 0.8


def free_cores() -> tuple[int, str]:
    """CPU cores free for this process now: the cores it may run on less the other jobs' threads
    runnable right now, at least 1. Returns (cores, how it was found). The 1-minute load average
    is only the fallback: it counts this process's own loading of the model as another job."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    busy = others_runnable()
    if busy is not None:
        what = f"{busy:g} other runnable"
    elif hasattr(os, "getloadavg"):
        busy = os.getloadavg()[0]
        what = f"load {busy:.2f}"
    else:
        return cores, f"{cores} cores"
    free = max(1, min(cores, int(cores - busy + 0.5)))
    return free, f"{cores} cores, {what}"


def others_runnable(reads: int = 5, gap_s: float = 0.04) -> float | None:
    """Threads of other processes runnable now: the median over a few reads of /proc/loadavg's
    running count, less the reading thread itself. None where /proc/loadavg is missing."""
    import statistics
    import time

    counts = []
    try:
        for k in range(reads):
            if k:
                time.sleep(gap_s)
            with open("/proc/loadavg", encoding="ascii") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return None
    return float(statistics.median(counts))


def available_memory_bytes() -> int | None:
    """Memory the kernel says a new allocation can take now (/proc/meminfo's MemAvailable);
    None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_share(cpu_s: float, seconds: float, threads: int, device: Any) -> float | None:
    """The share of its threads' time some work on the CPU had: process CPU seconds over wall
    seconds x threads. About 0.95 on a quiet machine; another process on the cores lowers it.
    None off the CPU, where the host thread waits on the device."""
    if getattr(device, "type", str(device)) != "cpu" or seconds <= 0 or threads <= 0:
        return None
    return round(cpu_s / (seconds * threads), 3)


def under_torchrun() -> bool:
    """True in a process started by torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK). Here, not
    in tunelab.stages.train.process_group, so that the CLI can ask without importing torch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
