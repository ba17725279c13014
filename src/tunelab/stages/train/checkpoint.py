"""Checkpoints: everything a stopped run needs to continue exactly, written atomically.

```
checkpoints/step-000010/
  model/ or adapter/        trainable weights (safetensors; a LoRA adapter in peft's format)
  optimizer.safetensors     optimizer state tensors; optimizer.json holds the rest
  dcp/                      instead of optimizer.*, for a sharded model (FSDP): every rank's
                            shards of weights and optimizer (torch.distributed.checkpoint)
  scheduler.json            learning-rate scheduler state
  rng.safetensors           rank 0's torch (and CUDA) generator states, numpy's key array
  state.json                step, data position, config sha, data snapshot, strategy and world
                            size, the other ranks' generators, RNG rest, file sha256s
  DONE
checkpoints/final -> step-000100
```

This module owns the format: `save_checkpoint` and `load_checkpoint` for every strategy (a
sharded model's part goes through the strategy's `shard_writer`), `check_checkpoint_files`, the
one place where a checkpoint's files are checked before anything is loaded from them, and
`read_checkpoint_state`, which raises on what that check finds.

A checkpoint is written into a temporary folder beside its final name and renamed into place,
so a kill during a save leaves the previous checkpoint as the latest complete one. No pickle:
tensors go to safetensors, everything else to JSON. torch is imported only to write or load
tensors: checking files and reading state.json need none.

`save_checkpoint(root, step, *, model, optimizer, scheduler, scaler, method, state,
strategy=None) -> Path` and `load_checkpoint(path, *, model, optimizer=None, scheduler=None,
scaler=None, method, restore_rng_state=True, strategy=None) -> state`: every rank calls them; a
checkpoint of another strategy or world size is refused. `check_checkpoint_files(path) -> {path,
files_checked, changed, missing, ok}` (verify, smoke and export report it);
`read_checkpoint_state(path, verify=True)` raises CheckpointError on what it finds (and on a
damaged safetensors header); `load_weights(model, folder, method)`; the layout names of
`tunelab.stages.train.layout` (`list_checkpoints`, `latest_checkpoint`, `final_checkpoint`,
`mark_final`, `step_dir_name`) are re-exported. An optimizer state entry that is a dict of
tensors (bitsandbytes' 8-bit states) is stored as `PID.KEY/SUB`. state.json holds `strategy`,
`world_size`, `rank_rng` (the generator states of ranks 1..N-1) and, when training records
it, `save_s`.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import signal
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import CheckpointError, StudyError
from tunelab.core.hashing import sha256_file
from tunelab.core.ledger import utc_now
from tunelab.core.record_train import CheckpointState
from tunelab.core.records import (
    publish_dir,
    read_json,
    safe_join,
    temp_dir_beside,
    write_json_atomic,
)
from tunelab.core.safetensors_header import require_safetensors, safetensors_problems
from tunelab.stages.train.layout import (  # noqa: F401 (part of this module's interface)
    _STEP_RE,
    FINAL,
    final_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    mark_final,
    step_dir_name,
)
from tunelab.stages.train.resume_check import optimizer_layout, require_resume_state, rng_layout
from tunelab.stages.train.strategy import SingleProcess, Strategy

if TYPE_CHECKING:
    import torch

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_REST = "optimizer.json"
SCHEDULER = "scheduler.json"
RNG = "rng.safetensors"
STATE = "state.json"

# ------------------------------------------------------------------ weights


def save_weights(model: torch.nn.Module, folder: Path, method: str) -> Path:
    """The trained tensors: `adapter/` (LoRA, peft format) or `model/` (full, freeze)."""
    from tunelab.lib.models import save_trainable, trainable_dirname

    return save_trainable(model, folder / trainable_dirname(method), method)


def load_weights(model: torch.nn.Module, folder: Path, method: str) -> torch.nn.Module:
    """Load a checkpoint's trained tensors into an adapted model (resume) or a fresh base model
    (evaluation); returns the model to use."""
    from tunelab.lib.models import load_trainable, trainable_dirname

    return load_trainable(model, folder / trainable_dirname(method), method)


# ------------------------------------------------------------------ optimizer


def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """optimizer.state_dict() -> (tensors for safetensors, JSON-able rest)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    for pid, entry in sd["state"].items():
        rest[str(pid)] = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            elif isinstance(value, dict):  # bitsandbytes' 8-bit states: one dict of tensors
                for sub, t in value.items():
                    tensors[f"{pid}.{key}/{sub}"] = t.detach().cpu().contiguous()
            else:
                rest[str(pid)][key] = value
    return tensors, {"param_groups": sd["param_groups"], "state": rest}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(pid): dict(rest) for pid, rest in meta["state"].items()}
    for name, t in tensors.items():
        pid, key = name.split(".", 1)
        entry = state.setdefault(int(pid), {})
        if "/" in key:
            key, sub = key.split("/", 1)
            entry.setdefault(key, {})[sub] = t
        else:
            entry[key] = t
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _save_replica(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, method: str
) -> dict[str, Any]:
    """A whole model on one rank: its trainable weights and the optimizer's state."""
    from safetensors.torch import save_file

    save_weights(model, folder, method)
    opt_tensors, opt_rest = flatten_optimizer(optimizer.state_dict())
    save_file(opt_tensors, str(folder / OPTIMIZER_TENSORS))
    write_json_atomic(folder / OPTIMIZER_REST, opt_rest)
    return {"optimizer_layout": optimizer_layout(model, optimizer)}


def _load_replica(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, method: str
) -> None:
    from safetensors.torch import load_file

    loaded = load_weights(model, folder, method)
    assert loaded is model, "resume loads into the adapted model in place"
    if optimizer is not None:
        meta = read_json(folder / OPTIMIZER_REST)
        optimizer.load_state_dict(
            unflatten_optimizer(load_file(str(folder / OPTIMIZER_TENSORS)), meta)
        )


# ------------------------------------------------------------------ RNG


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Generator states of python, numpy, torch and CUDA: (tensors, JSON-able rest)."""
    import numpy as np
    import torch

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
    import numpy as np
    import torch

    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(rest.get("cuda_devices", 0))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    n = rest["numpy"]
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    p = rest["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def encode_rng() -> dict[str, Any]:
    """This process's generator states as JSON (a few KB), for the ranks other than 0."""
    tensors, rest = capture_rng()
    encoded = {
        name: {
            "dtype": str(t.dtype).removeprefix("torch."),
            "base64": base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii"),
        }
        for name, t in tensors.items()
    }
    return {"tensors": encoded, "rest": rest}


def decode_rng(saved: dict[str, Any]) -> None:
    """Restore the generator states `encode_rng` wrote."""
    import torch

    tensors = {
        name: torch.frombuffer(
            bytearray(base64.b64decode(t["base64"])), dtype=getattr(torch, t["dtype"])
        )
        for name, t in saved["tensors"].items()
    }
    restore_rng(tensors, saved["rest"])


# ------------------------------------------------------------------ verifying


def check_checkpoint_files(path: Path) -> dict[str, Any]:
    """Every file listed in the checkpoint's state.json against its recorded sha256, and the
    header of each safetensors file; a checkpoint's files are checked here, and only here,
    before anything is loaded from them.

    Returns {path, files_checked, changed: [names], missing: [names], damaged: {name: why},
    ok}: `missing` names DONE or state.json when the checkpoint is incomplete, `damaged` holds
    files whose hash matches but which cannot be loaded (a header rewritten with its hash), a
    name that leads out of the folder, or state.json without its list of files.
    """
    out: dict[str, Any] = {"path": str(path), "files_checked": 0, "changed": [], "missing": []}
    out["damaged"] = {}
    if not (path / "DONE").exists() or not (path / STATE).exists():
        out["missing"] = ["DONE" if not (path / "DONE").exists() else STATE]
        return {**out, "ok": False}
    state = read_json(path / STATE)
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(files, dict):
        out["damaged"] = {STATE: "no list of files with their sha256"}
        return {**out, "ok": False}
    for name, digest in sorted(files.items()):
        try:
            f = safe_join(path, name)
        except StudyError:
            out["damaged"][name] = "the name leads out of the checkpoint's folder"
            continue
        if not f.is_file():
            out["missing"].append(name)
        elif sha256_file(f) != digest:
            out["changed"].append(name)
        elif name.endswith(".safetensors") and (problems := safetensors_problems(f)):
            out["damaged"][name] = "; ".join(problems)
    ok = bool(files) and not out["changed"] and not out["missing"] and not out["damaged"]
    return {**out, "files_checked": len(files), "ok": ok}


def read_checkpoint_state(path: Path, verify: bool = True) -> CheckpointState:
    """state.json of a complete checkpoint, its files checked (`check_checkpoint_files`).

    Raises CheckpointError on an incomplete checkpoint, a state.json without its list of files,
    and (`verify`) a missing, changed or damaged file.
    """
    if not (path / "DONE").exists() or not (path / STATE).exists():
        raise CheckpointError(
            f"{path}: incomplete checkpoint (no DONE marker)",
            hint="resume uses the latest complete checkpoint; this one was cut by a kill",
        )
    damaged_hint = "the checkpoint is damaged; resume from an earlier one or start a new run"
    raw = read_json(path / STATE)
    if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
        raise CheckpointError(f"{path / STATE}: no list of files with their sha256", damaged_hint)
    try:
        state = CheckpointState.of(path / STATE, raw)
    except StudyError as e:
        raise CheckpointError(e.message, damaged_hint) from None
    if not verify:
        return state
    found = check_checkpoint_files(path)
    bad = sorted(found["changed"] + found["missing"])
    if bad:
        raise CheckpointError(
            f"{path / bad[0]}: missing or changed since the checkpoint was written", damaged_hint
        )
    outside = [n for n in found["damaged"] if not n.endswith(".safetensors")]
    if outside:
        raise CheckpointError(f"{path}: {outside[0]}: {found['damaged'][outside[0]]}", damaged_hint)
    require_safetensors([path / n for n in sorted(found["damaged"])], f"checkpoint {path}")
    return state


# ------------------------------------------------------------------ save / load


def kill_for_test(point: str, step: int) -> None:
    """Only for the test suite: signal this process at a named point, from
    TUNELAB_TEST_KILL_AT="step:5" (SIGKILL after step 5), "save:6" (SIGKILL in the middle of
    writing checkpoint 6), "term:5" (SIGTERM after step 5) or "hold:5" (stop after step 5
    until the test kills the process)."""
    wanted = os.environ.get("TUNELAB_TEST_KILL_AT")
    if not wanted:
        return
    if point == "step" and wanted == f"hold:{step}":
        while True:
            signal.pause()
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
    strategy: Strategy | None = None,
    shards_at: str | None = None,
) -> Path:
    """Write checkpoints/step-XXXXXX atomically; `state` holds position, config sha, ...

    Under a distributed strategy every rank calls it and gets the same path: rank 0 writes the
    folder; a sharded model's ranks hand their state to its `shard_writer` (a full fine-tune's
    shards go to `shards_at` on several nodes), and every rank's generator states go into
    state.json. The other ranks read and write nothing of `root`.
    """
    from safetensors.torch import save_file

    strategy = strategy or SingleProcess()
    final = root / step_dir_name(step)
    if strategy.broadcast_object(final.exists() if strategy.is_main else None):
        return final
    tmp = None
    if strategy.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir_beside(final)
    # rank 0's generators go to rng.safetensors; every other rank's (its dropout masks differ)
    # to state.json, so that a resumed run draws what the uninterrupted one would have
    rank_rng = strategy.gather_objects(encode_rng())[1:]
    model = strategy.unwrap(model)
    writer = strategy.shard_writer
    if writer is not None:
        fields = writer.save(tmp, model, optimizer, method, shards_at)
    else:
        fields = _save_replica(tmp, model, optimizer, method) if tmp is not None else {}
    if tmp is not None:
        kill_for_test("save", step)
        write_json_atomic(tmp / SCHEDULER, scheduler.state_dict())
        rng_tensors, rng_rest = capture_rng()
        save_file(rng_tensors, str(tmp / RNG))
        files = {
            str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        record = {
            **state,
            "strategy": strategy.name,
            "world_size": strategy.world_size,
            "rank_rng": rank_rng,
            "step": step,
            "rng": rng_rest,
            "rng_layout": rng_layout(rng_tensors),
            "grad_scaler": scaler.state_dict()
            if scaler is not None and scaler.is_enabled()
            else None,
            **fields,
            "saved_at": utc_now(),
            "files": files,
        }
        write_json_atomic(tmp / STATE, record)
        publish_dir(tmp, final)
    strategy.barrier()
    return final


def _read_for_resume(
    path: Path, strategy: Strategy, optimizer: Any, scheduler: Any
) -> dict[str, Any]:
    """Rank 0: what every rank needs of checkpoint `path` (its state.json, the scheduler's
    state, where a sharded model's shards are). Raises CheckpointError on a damaged
    checkpoint or one written by another strategy or number of processes."""
    state = read_checkpoint_state(path)
    if optimizer is not None:
        require_resume_state(path, state.raw)
    saved = state.launched
    if saved != (strategy.name, strategy.world_size):
        raise CheckpointError(
            f"{path} was written by --strategy {saved[0]} on {saved[1]} process(es), not "
            f"{strategy.name} on {strategy.world_size}",
            hint="resume with the strategy and --nproc the run was started with",
        )
    writer = strategy.shard_writer
    return {
        "state": state,
        "scheduler": read_json(path / SCHEDULER) if scheduler is not None else None,
        "shards": writer.shards_of(path, state) if writer is not None else None,
    }


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    scaler: torch.amp.GradScaler | None = None,
    method: str,
    restore_rng_state: bool = True,
    strategy: Strategy | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into the given objects; returns its state.json.

    Every rank of a distributed strategy calls it; rank 0 reads the checkpoint and gives the
    other ranks what they need (they read nothing of `path`). Raises CheckpointError on a
    damaged checkpoint or one written by another strategy or number of processes.
    """
    from safetensors.torch import load_file

    from tunelab.stages.train.nodes import from_main

    strategy = strategy or SingleProcess()
    found = from_main(strategy, lambda: _read_for_resume(path, strategy, optimizer, scheduler))
    state = found["state"]
    model = strategy.unwrap(model)
    if strategy.shard_writer is not None:
        folder = path if strategy.is_main else None
        strategy.shard_writer.load(folder, model, optimizer, method, found["shards"])
    else:
        if strategy.is_main:
            _load_replica(path, model, optimizer, method)
        share_replica(strategy, model, optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(found["scheduler"])
    if scaler is not None and state.grad_scaler:
        scaler.load_state_dict(state.grad_scaler)
    if restore_rng_state:
        if strategy.is_main:
            restore_rng(load_file(str(path / RNG)), state.rng)
        else:
            decode_rng((state.rank_rng or [])[strategy.rank - 1])
    return state


def share_replica(
    strategy: Strategy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """After rank 0 loaded a replica checkpoint (DDP): its trainable weights and optimizer
    state on every rank, through the process group. A collective."""
    if strategy.world_size == 1:
        return
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)
    if optimizer is None:
        return
    tensors, rest = flatten_optimizer(optimizer.state_dict()) if strategy.is_main else ({}, None)
    rest = strategy.broadcast_object(rest)
    tensors = broadcast_tensors(strategy, tensors)
    if not strategy.is_main:
        optimizer.load_state_dict(unflatten_optimizer(tensors, rest))


def broadcast_tensors(strategy: Strategy, tensors: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's named CPU tensors on every rank (names, shapes and dtypes first). A
    collective."""
    import torch
    import torch.distributed as dist

    shapes = {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}
    shapes = strategy.broadcast_object(shapes if strategy.is_main else None)
    device = getattr(strategy, "comm_device", torch.device("cpu"))
    out = {}
    for name, (shape, dtype) in shapes.items():
        if strategy.is_main:
            t = tensors[name].to(device)
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(t, src=0)
        out[name] = t.cpu()
    return out


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` checkpoints and the final one; stale temp folders too,
    and the shards a removed checkpoint kept in the shard store.

    A checkpoint is first renamed to a hidden name, so a kill during removal never leaves a
    half-deleted folder that looks complete.
    """
    from tunelab.stages.train import shard_store

    keep = {p for _, p in list_checkpoints(root)[-keep_last:]}
    final = final_checkpoint(root)
    removed = []
    for _, p in list_checkpoints(root):
        if p not in keep and p != final:
            shards = read_json(p / STATE).get("shards") if (p / STATE).is_file() else None
            trash = root / f".trash-{p.name}-{uuid.uuid4().hex[:8]}"
            os.replace(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
            if shards:
                shard_store.remove(shards)
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
