"""DDP and FSDP2 strategies for the training loop.

A distributed run is the single-process loop started once per rank by torchrun
(`tunelab.stages.train.launch`). The strategies implement `tunelab.stages.train.strategy.Strategy`:

- data: every rank reads the same seeded order; an optimizer step takes the next
  `micro * accum * world_size` indices and rank r keeps `indices[r::world_size]`, so micro-step k
  of all ranks together holds exactly the examples of micro-step k of one process with a micro
  batch `world_size` times larger;
- loss: the step's loss-token count is all-reduced, the loop divides each rank's summed loss by
  `tokens / world_size`, and DDP / FSDP average gradients over ranks, so the gradient is the
  global token sum divided by the global token count: N ranks x micro b equal 1 rank x N*b;
- gradients are synchronized on the last micro-step of an accumulation only (DDP `no_sync`,
  FSDP2 `set_requires_gradient_sync`).

FSDP2 (`fully_shard`) shards each decoder layer then the root; its checkpoints go through its
shard writer (`tunelab.stages.train.sharded`). The process group is `tunelab.stages.train.process_group`'s.

`make_strategy(name, precision)`, `shard_step`, `decoder_layers`; the `DDP` and `FSDP` classes.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from tunelab.core.errors import ConfigError, RunError
from tunelab.stages.train.launch_dir import fail_for_test
from tunelab.stages.train.precision import resolve_precision
from tunelab.stages.train.process_group import backend_version, device_name, init_process_group
from tunelab.stages.train.sharded import ShardedCheckpoint
from tunelab.stages.train.sharded_load import (
    before_sharding,
    is_skeleton,
    materialize,
    sharded_load_wanted,
)
from tunelab.stages.train.strategy import ShardWriter

STRATEGIES = ("ddp", "fsdp")


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
    shard_writer: ShardWriter | None = None

    def __init__(self, precision: str = "fp32"):
        self.rank, self.world_size, self.local_rank, self.device, self.backend = (
            init_process_group()
        )
        self.precision = resolve_precision(precision, self.device)

    def use_precision(self, precision: str) -> None:
        """Compute in `precision` (training.precision) from now on: before the model is wrapped."""
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
            "device": device_name(self.device),
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


# A diagnostic for the benchmark: "broadcast-all" keeps DDP's own start-up broadcast of every
# weight (the losses are the same; only memory differs).
DDP_START_ENV = "TUNELAB_DDP_START"


def start_equal(model: torch.nn.Module) -> None:
    """Every replica starts from rank 0's values, broadcasting only what training changes.

    Frozen weights were read by every rank from the same files: DDP's own start-up broadcast
    would rewrite each of them in place, turning the node's one mapped copy of the files into a
    private copy per rank (benchmarks/fsdp_load.py --ddp). They are checked equal instead, by a
    float64 sum per tensor; every rank raises the same error when one differs. A collective."""
    with torch.no_grad():
        for t in [p for p in model.parameters() if p.requires_grad] + list(model.buffers()):
            dist.broadcast(t.data, src=0)
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        if not frozen:
            return
        sums = torch.stack([torch.sum(p.detach(), dtype=torch.float64) for _, p in frozen])
        every = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
        dist.all_gather(every, sums)
    for rank, theirs in enumerate(every[1:], start=1):
        differs = ~torch.isclose(theirs, every[0], rtol=1e-9, atol=0.0, equal_nan=True)
        if bool(differs.any()):
            raise RunError(
                f"rank {rank}'s frozen weight {frozen[int(differs.nonzero()[0])][0]} differs "
                "from rank 0's",
                hint="every node must hold the same base model files (the same hub revision "
                "or the same local copy); copy node 0's base to that node",
            )


class DDP(Distributed):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced (averaged)."""

    name = "ddp"

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        fail_for_test(self.rank)
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        own_sync = os.environ.get(DDP_START_ENV) == "broadcast-all"
        if not own_sync:
            start_equal(model)
        return DistributedDataParallel(model, device_ids=device_ids, init_sync=own_sync)

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
        self.shard_writer = ShardedCheckpoint(self)
        self.bytes_read: int | None = None  # from the weight files, when loaded sharded

    def loads_sharded(self, base: Any, cfg: Any) -> bool:
        """Whether `build_model` gives this strategy a skeleton to shard and fill."""
        return sharded_load_wanted(base, cfg)

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
        skeleton = is_skeleton(model)
        if skeleton:  # sharded loading: each rank fills its shards after fully_shard
            pending = before_sharding(model)
        else:
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
        if skeleton:
            self.bytes_read = materialize(model, pending, self.device, self.rank, self.world_size)
        model.register_forward_hook(_reshard_after_no_grad_forward)
        return model

    def accumulate(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        # Gradients are reduce-scattered only after the last micro-step's backward.
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()


def _reshard_after_no_grad_forward(module: Any, args: Any, output: Any) -> None:
    # FSDP2 keeps the root's parameters unsharded after its forward, expecting the backward.
    # After an evaluation forward no backward follows; left unsharded, those parameters
    # (embeddings, final norm, tied head) get wrong gradients in the next training step. An
    # explicit reshard is the remedy FSDP's authors give (pytorch/pytorch#154655).
    if not torch.is_grad_enabled():
        module.reshard()


def strategy_problems(cfg: Any, strategy: str) -> list[str]:
    """Why the study cannot train under `strategy` (`field: why` lines; empty when it can)."""
    if strategy != "fsdp":
        return []
    problems = []
    if cfg.adaptation.method == "qlora":
        problems.append(
            "adaptation.method: qlora cannot run under --strategy fsdp: bitsandbytes' 4-bit "
            "weights keep their quantization state (scales, shape) beside the packed bytes, and "
            "FSDP2's fully_shard would split the bytes and drop that state (use --strategy ddp: "
            "each rank holds the 4-bit base, a quarter of its bf16 size)"
        )
    if cfg.training.precision == "fp16":
        problems.append(
            "training.precision: fp16 is not supported with --strategy fsdp (its grad scaler "
            "over sharded gradients is not tested; use bf16 or fp32)"
        )
    return problems


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
