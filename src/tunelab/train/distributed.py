"""DDP and FSDP2 strategies for the training loop, and the process group they run in.

A distributed run is the single-process loop started once per rank by torchrun
(`tunelab.train.launch`). The strategies implement `tunelab.train.strategy.Strategy`:

- data: every rank reads the same seeded order; an optimizer step takes the next
  `micro * accum * world_size` indices and rank r keeps `indices[r::world_size]`, so micro-step k
  of all ranks together holds exactly the examples of micro-step k of one process with a micro
  batch `world_size` times larger;
- loss: the step's loss-token count is all-reduced, the loop divides each rank's summed loss by
  `tokens / world_size`, and DDP / FSDP average gradients over ranks, so the gradient is the
  global token sum divided by the global token count: N ranks x micro b equal 1 rank x N*b;
- gradients are synchronized on the last micro-step of an accumulation only (DDP `no_sync`,
  FSDP2 `set_requires_gradient_sync`).

FSDP2 (`fully_shard`) shards each decoder layer then the root; its checkpoints go through
torch.distributed.checkpoint (each rank writes its shards). Only rank 0 writes records; a rank
that fails writes `rank-<k>.json` into the launch folder (`TUNELAB_LAUNCH_DIR`), which the
launcher copies into the run's `ranks/` folder and names in the run's status.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import signal
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tunelab.env import under_torchrun
from tunelab.errors import CheckpointError, ConfigError, RunError
from tunelab.ledger import utc_now
from tunelab.records import publish_dir, read_json, sha256_file, temp_dir_beside, write_json_atomic
from tunelab.study import Run, Study
from tunelab.train import checkpoint as ckpt
from tunelab.train.compute import resolve_precision
from tunelab.train.strategy import SingleProcess, Strategy

STRATEGIES = ("ddp", "fsdp")
LAUNCH_DIR_ENV = "TUNELAB_LAUNCH_DIR"
# How long a collective waits for a missing rank before failing (torchrun usually stops the
# other ranks first, when one exits with an error).
TIMEOUT_S = float(os.environ.get("TUNELAB_DIST_TIMEOUT_S", "1800"))


# ------------------------------------------------------------------ process group


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
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=TIMEOUT_S)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    return rank, world, local_rank, device, backend


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ strategies


def shard_step(indices: list[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s share of one optimizer step's examples: every world_size-th from `rank`.

    Cut into micro-batches of b, micro-step k of all ranks together holds
    `indices[k*b*world_size : (k+1)*b*world_size]`: micro-step k of one process with a micro
    batch of b*world_size.
    """
    if len(indices) % world_size:
        raise RunError(
            f"{len(indices)} examples in a step cannot be split over {world_size} ranks",
            hint="examples per step are micro_batch_size x grad_accum_steps x nproc",
        )
    return indices[rank::world_size]


class Distributed:
    """What DDP and FSDP share: ranks, sharding of each step's examples, reductions."""

    name = "distributed"

    def __init__(self, precision: str = "fp32"):
        self.rank, self.world_size, self.local_rank, self.device, self.backend = (
            init_process_group()
        )
        self.precision = resolve_precision(precision, self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard_indices(self, indices: list[int]) -> list[int]:
        return shard_step(indices, self.rank, self.world_size)

    def all_reduce_sum(self, value: float) -> float:
        # float64: token counts stay exact integers, loss sums keep their digits
        t = torch.tensor(float(value), dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (e.g. the run folder that rank 0 created)."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def describe(self) -> dict[str, Any]:
        """The `distributed` entry of env.json; a collective: every rank must call it."""
        me = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "device": _device_name(self.device),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        return {
            "strategy": self.name,
            "world_size": self.world_size,
            "backend": self.backend,
            "backend_version": backend_version(self.backend),
            "ranks": self.gather_objects(me),
        }


class DDP(Distributed):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced (averaged)."""

    name = "ddp"

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        fail_for_test(self.rank)
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers, so every replica starts equal.
        return DistributedDataParallel(model, device_ids=device_ids)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    def accumulate(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else model.no_sync()


class FSDP(Distributed):
    """FSDP2: parameters, gradients and optimizer states sharded over ranks (`fully_shard`)."""

    name = "fsdp"

    def __init__(self, precision: str = "fp32"):
        super().__init__(precision)
        if precision == "fp16":
            raise ConfigError(
                "training.precision: fp16 is not supported with --strategy fsdp",
                hint="use --set training.precision=bf16 or fp32",
            )

    def mixed_precision(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.precision == "bf16":
            # compute in bf16; reduce gradients in fp32; the sharded weights keep the model's
            # dtype (fp32 masters when model.dtype is float32)
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        fail_for_test(self.rank)
        model = model.to(self.device)
        # fully_shard keeps each rank's own values: start every rank from rank 0's weights
        # (newly initialized heads and LoRA matrices differ when seeds differ).
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        policy = self.mixed_precision()
        layers = decoder_layers(model)
        if not layers:
            raise RunError(
                f"--strategy fsdp found no transformer blocks in {type(unwrap_peft(model)).__name__}",
                hint="FSDP shards per transformer block (the model's _no_split_modules or its "
                "list of layers); use --strategy ddp for this model",
            )
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.register_forward_hook(_reshard_after_no_grad_forward)
        return model

    def accumulate(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        # Gradients are reduce-scattered only after the last micro-step's backward.
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()


def _reshard_after_no_grad_forward(module: Any, args: Any, output: Any) -> None:
    # FSDP2 keeps the root's parameters unsharded after its forward, expecting the backward.
    # After an evaluation forward (no backward follows) they stayed unsharded, and the next
    # training step's gradients of those parameters (embeddings, final norm, tied head) were
    # wrong (grad norm 0.26 instead of 1.54 on the tiny Llama, full fine-tuning, torch 2.13).
    # An explicit reshard is the remedy FSDP's authors give (pytorch/pytorch#154655).
    if not torch.is_grad_enabled():
        module.reshard()


def make_strategy(name: str, precision: str = "fp32") -> Distributed:
    """The strategy `--strategy` names, joined to torchrun's process group."""
    if name == "ddp":
        return DDP(precision)
    if name == "fsdp":
        return FSDP(precision)
    raise ConfigError(
        f"--strategy {name!r}: unknown", hint=f"use one of: single, {', '.join(STRATEGIES)}"
    )


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one: modules whose class the model lists in
    `_no_split_modules` (transformers' own unit of placement), else the entries of the
    ModuleList holding the most parameters (BERT's `encoder.layer` lists no such class)."""
    base = unwrap_peft(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(biggest)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


# ------------------------------------------------------------------ FSDP checkpoints (DCP)

DCP_DIR = "dcp"


def _state_options(full: bool = False, load: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen base weights never change: a LoRA checkpoint holds the adapter and its optimizer.
    # Loading such a state dict must not be strict (the frozen keys are absent on purpose);
    # dcp.load has already refused a checkpoint missing any trainable key.
    return StateDictOptions(
        ignore_frozen_params=True, full_state_dict=full, cpu_offload=full, strict=not load
    )


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Every rank writes its shards of the trainable weights and optimizer states to
    `folder/dcp` (torch.distributed.checkpoint). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    out = folder / DCP_DIR
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(out))
    return out


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load `folder/dcp` into the sharded model and optimizer (any world size). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    src = folder / DCP_DIR
    if not (src / ".metadata").exists():
        raise RunError(
            f"{src}: no torch.distributed.checkpoint here",
            hint="this checkpoint was not written by --strategy fsdp; resume it with the "
            "strategy that wrote it",
        )
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(src))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_state_options(load=True),
    )


def full_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors gathered whole on CPU (rank 0 gets them; others an empty dict).
    A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_options(full=True))


# ------------------------------------------------------------------ runs: only rank 0 writes


class FollowerRun(Run):
    """The run as ranks other than 0 hold it: same folder, but statuses and heartbeats are
    rank 0's to write."""

    def set_status(self, status: str, reason: str | None = None, **extra: Any) -> None:
        pass

    def heartbeat(self) -> None:
        pass


def environment(strategy: Strategy | None) -> dict[str, Any]:
    """env.json of a run; a distributed run adds every rank's device and the backend with its
    version under `distributed`. A collective under a distributed strategy."""
    from tunelab.env import capture_env

    env = capture_env()
    if isinstance(strategy, Distributed):
        env["distributed"] = {**env.get("distributed", {}), **strategy.describe()}
    return env


def create_run(strategy: Strategy | None, study: Study, kind: str, **kwargs: Any) -> Run:
    """`study.create_run(kind, **kwargs)` on rank 0; the other ranks get the same run as a
    FollowerRun (they write no record)."""
    if not isinstance(strategy, Distributed):
        return study.create_run(kind, **kwargs)
    run = study.create_run(kind, **kwargs) if strategy.is_main else None
    if run is not None:
        announce_run(run.id, run.dir)
    run_id, run_dir = strategy.broadcast_object((run.id, str(run.dir)) if run else None)
    return run if run is not None else FollowerRun(study, run_id, Path(run_dir))


def follow(strategy: Strategy | None, run: Run) -> Run:
    """Before a resumed run goes on: the strategy and world size must be the recorded ones;
    every rank has finished its checks; ranks other than 0 get a FollowerRun."""
    from tunelab.train.launch import recorded_launch

    strategy = strategy or SingleProcess()
    recorded = recorded_launch(run.dir)
    name = strategy.name if isinstance(strategy, Distributed) else "single"
    if (recorded.strategy, recorded.world_size) != (name, strategy.world_size):
        raise RunError(
            f"run {run.id} was trained with --strategy {recorded.strategy} on "
            f"{recorded.world_size} process(es), not {name} on {strategy.world_size}",
            hint=f"`tunelab resume {run.id}` (it relaunches with the recorded strategy), or "
            "start a new run: the global batch depends on the number of processes",
        )
    if not isinstance(strategy, Distributed):
        return run
    strategy.barrier()
    if strategy.is_main:
        announce_run(run.id, run.dir)
        return run
    return FollowerRun(run.study, run.id, run.dir)


def agreed_stop(strategy: Strategy, signum: int | None) -> int | None:
    """A stop signal seen by any rank stops every rank after the same step (their checkpoint
    save is collective)."""
    if not isinstance(strategy, Distributed):
        return signum
    if strategy.all_reduce_sum(1.0 if signum is not None else 0.0) > 0:
        return signum if signum is not None else int(signal.SIGTERM)
    return None


# ------------------------------------------------------------------ checkpoints


def save_checkpoint(strategy: Strategy, root: Path, step: int, **kwargs: Any) -> Path:
    """`checkpoint.save_checkpoint` for any strategy (same keyword arguments).

    Single process: as is. DDP: rank 0 writes the (identical) replica's checkpoint. FSDP: every
    rank writes its shards of weights and optimizer through torch.distributed.checkpoint into
    `dcp/`; rank 0 adds the gathered trainable weights (`adapter/` or `model/`, for evaluation
    and export), scheduler, RNG and state.json. Every rank returns the same path.
    """
    if not isinstance(strategy, Distributed):
        return ckpt.save_checkpoint(root, step, **kwargs)
    kwargs["state"] = {
        **kwargs["state"],
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        # rank 0's generators go to rng.safetensors; every other rank's (its dropout masks
        # differ) here, so that a resumed run draws what the uninterrupted one would have
        "rank_rng": strategy.gather_objects(_encode_rng())[1:],
    }
    if isinstance(strategy, FSDP):
        path = _save_fsdp(strategy, root, step, **kwargs)
    else:
        path = None
        if strategy.is_main:
            kwargs["model"] = strategy.unwrap(kwargs["model"])
            path = ckpt.save_checkpoint(root, step, **kwargs)
        path = strategy.broadcast_object(str(path) if path else None)
    return Path(path)


def load_checkpoint(strategy: Strategy, path: Path, **kwargs: Any) -> dict[str, Any]:
    """`checkpoint.load_checkpoint` for any strategy: every rank loads the same checkpoint
    (FSDP: its own shards, through torch.distributed.checkpoint)."""
    state = ckpt.read_checkpoint_state(path)
    saved = (state.get("strategy", "single"), int(state.get("world_size", 1)))
    name = strategy.name if isinstance(strategy, Distributed) else "single"
    if saved != (name, strategy.world_size):
        raise CheckpointError(
            f"{path} was written by --strategy {saved[0]} on {saved[1]} process(es), not "
            f"{name} on {strategy.world_size}",
            hint="resume with the strategy and --nproc the run was started with",
        )
    if not isinstance(strategy, Distributed):
        return ckpt.load_checkpoint(path, **kwargs)
    if isinstance(strategy, DDP):
        kwargs["model"] = strategy.unwrap(kwargs["model"])
        ckpt.load_checkpoint(path, **kwargs)
    else:
        load_sharded(path, kwargs["model"], kwargs["optimizer"])
        if kwargs.get("scheduler") is not None:
            kwargs["scheduler"].load_state_dict(read_json(path / "scheduler.json"))
        if kwargs.get("restore_rng_state", True):
            ckpt.restore_rng(load_file(str(path / "rng.safetensors")), state["rng"])
    if kwargs.get("restore_rng_state", True) and strategy.rank > 0:
        _decode_rng(state["rank_rng"][strategy.rank - 1])
    return state


def _encode_rng() -> dict[str, Any]:
    """This process's generator states as JSON (small: a few KB)."""
    tensors, rest = ckpt.capture_rng()
    encoded = {
        name: {
            "dtype": str(t.dtype).removeprefix("torch."),
            "base64": base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii"),
        }
        for name, t in tensors.items()
    }
    return {"tensors": encoded, "rest": rest}


def _decode_rng(saved: dict[str, Any]) -> None:
    tensors = {
        name: torch.frombuffer(
            bytearray(base64.b64decode(t["base64"])), dtype=getattr(torch, t["dtype"])
        )
        for name, t in saved["tensors"].items()
    }
    ckpt.restore_rng(tensors, saved["rest"])


def _save_fsdp(
    strategy: FSDP,
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
    from tunelab.models import trainable_dirname

    final = root / ckpt.step_dir_name(step)
    if strategy.broadcast_object(final.exists()):
        return final
    tmp = None
    if strategy.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir_beside(final)
    tmp = Path(strategy.broadcast_object(str(tmp) if tmp else None))
    save_sharded(tmp, model, optimizer)
    weights = full_trainable_state(model)  # [full tensors on rank 0's CPU]
    if strategy.is_main:
        write_trainable(model, weights, tmp / trainable_dirname(method), method)
        ckpt.kill_for_test("save", step)
        write_json_atomic(tmp / "scheduler.json", scheduler.state_dict())
        rng_tensors, rng_rest = ckpt.capture_rng()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        files = {
            str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        record = {
            **state,
            "step": step,
            "rng": rng_rest,
            "grad_scaler": None,
            "optimizer": f"{DCP_DIR}/ (torch.distributed.checkpoint, sharded)",
            "saved_at": utc_now(),
            "files": files,
        }
        write_json_atomic(tmp / "state.json", record)
        publish_dir(tmp, final)
    strategy.barrier()
    return final


def write_trainable(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], out: Path, method: str
) -> Path:
    """Gathered trainable weights in the format `tunelab.models.save_trainable` writes, so that
    evaluation, verify and export load an FSDP run like any other."""
    from tunelab.models._quiet import quiet_transformers
    from tunelab.models.persist import FREEZE_FILE

    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        if method in ("lora", "full"):
            # peft and transformers write these tensors instead of reading the sharded model
            model.save_pretrained(out, state_dict=weights, safe_serialization=True)
        else:
            tensors = {n: t.contiguous() for n, t in weights.items()}
            save_file(tensors, str(out / FREEZE_FILE), metadata={"format": "pt"})
            (out / "trainable.json").write_text(
                json.dumps({"method": "freeze", "tensors": sorted(tensors)}, indent=2) + "\n"
            )
    return out


# ------------------------------------------------------------------ failures of ranks


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


def announce_run(run_id: str, run_dir: Path) -> None:
    """Rank 0 tells the launcher which run this launch created (`run.json` in the launch dir)."""
    folder = launch_dir()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "run.json.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, "run_dir": str(run_dir)}))
    os.replace(tmp, folder / "run.json")
