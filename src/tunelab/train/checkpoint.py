"""Checkpoints: everything a stopped run needs to continue exactly, written atomically.

```
checkpoints/step-000010/
  model/ or adapter/        trainable weights (safetensors; a LoRA adapter in peft's format)
  optimizer.safetensors     optimizer state tensors; optimizer.json holds the rest
  scheduler.json            learning-rate scheduler state
  rng.safetensors           torch (and CUDA) generator states, numpy's key array
  state.json                step, data position, config sha, data snapshot, RNG rest, file sha256s
  DONE
checkpoints/final -> step-000100
```

A checkpoint is written into a temporary folder beside its final name and renamed into place,
so a kill during a save leaves the previous checkpoint as the latest complete one. No pickle:
tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tunelab.errors import CheckpointError
from tunelab.ledger import utc_now
from tunelab.records import (
    publish_dir,
    read_json,
    safe_join,
    sha256_file,
    temp_dir_beside,
    write_json_atomic,
)
from tunelab.safetensors_header import require_safetensors
from tunelab.train.layout import (  # noqa: F401 (part of this module's interface)
    _STEP_RE,
    FINAL,
    final_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    mark_final,
    step_dir_name,
)

# ------------------------------------------------------------------ weights


def save_weights(model: torch.nn.Module, folder: Path, method: str) -> Path:
    """The trained tensors: `adapter/` (LoRA, peft format) or `model/` (full, freeze)."""
    from tunelab.models import save_trainable, trainable_dirname

    return save_trainable(model, folder / trainable_dirname(method), method)


def load_weights(model: torch.nn.Module, folder: Path, method: str) -> torch.nn.Module:
    """Load a checkpoint's trained tensors into an adapted model (resume) or a fresh base model
    (evaluation); returns the model to use."""
    from tunelab.models import load_trainable, trainable_dirname

    return load_trainable(model, folder / trainable_dirname(method), method)


# ------------------------------------------------------------------ optimizer


def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """optimizer.state_dict() -> (tensors for safetensors, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    for pid, entry in sd["state"].items():
        rest[str(pid)] = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                rest[str(pid)][key] = value
    return tensors, {"param_groups": sd["param_groups"], "state": rest}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(pid): dict(rest) for pid, rest in meta["state"].items()}
    for name, t in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = t
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------ RNG


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Generator states of python, numpy, torch and CUDA: (tensors, JSON-able rest)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy.keys"] = torch.from_numpy(keys.astype(np.int64))
    py_version, py_state, py_gauss = random.getstate()
    rest = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": cached},
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    return tensors, rest


def restore_rng(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(rest.get("cuda_devices", 0))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    n = rest["numpy"]
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    p = rest["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


# ------------------------------------------------------------------ save / load


def kill_for_test(point: str, step: int) -> None:
    """Only for the test suite: signal this process at a named point, from
    TUNELAB_TEST_KILL_AT="step:5" (SIGKILL after step 5), "save:6" (SIGKILL in the middle of
    writing checkpoint 6) or "term:5" (SIGTERM after step 5)."""
    wanted = os.environ.get("TUNELAB_TEST_KILL_AT")
    if not wanted:
        return
    if wanted == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "step" and wanted == f"term:{step}":
        os.kill(os.getpid(), signal.SIGTERM)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    method: str,
    state: dict[str, Any],
) -> Path:
    """Write checkpoints/step-XXXXXX atomically; `state` holds step, position, config sha, ..."""
    final = root / step_dir_name(step)
    if final.exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(final)
    save_weights(model, tmp, method)
    opt_tensors, opt_rest = flatten_optimizer(optimizer.state_dict())
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    write_json_atomic(tmp / "optimizer.json", opt_rest)
    kill_for_test("save", step)
    write_json_atomic(tmp / "scheduler.json", scheduler.state_dict())
    rng_tensors, rng_rest = capture_rng()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    record = {
        **state,
        "step": step,
        "rng": rng_rest,
        "grad_scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "saved_at": utc_now(),
        "files": files,
    }
    write_json_atomic(tmp / "state.json", record)
    return publish_dir(tmp, final)


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` checkpoints and the final one; stale temp folders too.

    A checkpoint is first renamed to a hidden name, so a kill during removal never leaves a
    half-deleted folder that looks complete.
    """
    keep = {p for _, p in list_checkpoints(root)[-keep_last:]}
    final = final_checkpoint(root)
    removed = []
    for _, p in list_checkpoints(root):
        if p not in keep and p != final:
            trash = root / f".trash-{p.name}-{uuid.uuid4().hex[:8]}"
            os.replace(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(p)
    return removed


def remove_stale_temp(root: Path) -> list[Path]:
    """Temporary folders left by a process killed while saving: never a checkpoint, removed."""
    stale = [
        p
        for p in root.glob(".*")
        if p.is_dir() and (".tmp-" in p.name or p.name.startswith(".trash-"))
    ]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def read_checkpoint_state(path: Path, verify: bool = True) -> dict[str, Any]:
    """state.json of a complete checkpoint, its files checked against their sha256."""
    if not (path / "DONE").exists() or not (path / "state.json").exists():
        raise CheckpointError(
            f"{path}: incomplete checkpoint (no DONE marker)",
            hint="resume uses the latest complete checkpoint; this one was cut by a kill",
        )
    state = read_json(path / "state.json")
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(
            f"{path / 'state.json'}: no list of files with their sha256",
            hint="the checkpoint is damaged; resume from an earlier one or start a new run",
        )
    if verify:
        for name, digest in files.items():
            f = safe_join(path, name)
            if not f.is_file() or sha256_file(f) != digest:
                raise CheckpointError(
                    f"{f}: missing or changed since the checkpoint was written",
                    hint="the checkpoint is damaged; resume from an earlier one or start a new run",
                )
        tensors = [path / name for name in sorted(files) if name.endswith(".safetensors")]
        require_safetensors(tensors, f"checkpoint {path}")
    return state


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    method: str,
    restore_rng_state: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into the given objects; returns its state.json."""
    state = read_checkpoint_state(path)
    loaded = load_weights(model, path, method)
    assert loaded is model, "resume loads into the adapted model in place"
    if optimizer is not None:
        meta = read_json(path / "optimizer.json")
        optimizer.load_state_dict(
            unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), meta)
        )
    if scheduler is not None:
        scheduler.load_state_dict(read_json(path / "scheduler.json"))
    if scaler is not None and state.get("grad_scaler"):
        scaler.load_state_dict(state["grad_scaler"])
    if restore_rng_state:
        restore_rng(load_file(str(path / "rng.safetensors")), state["rng"])
    return state
