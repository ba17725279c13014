"""How a training run computes: its precision, torch.compile of its blocks, its attention route.

- precision: `tunelab.stages.train.precision` (`training.precision: auto` and what it resolves to).
- `compile_blocks`: `training.compile: true` compiles each decoder block in place
  (`nn.Module.compile`: parameter names and checkpoints unchanged). The packed attention is
  left out of the compiled graphs (tunelab.stages.train.attention), so packed rows of any length run
  the same compiled code without recompiling. `check_compile` first makes sure the compiler
  toolchain is there (a C++ compiler on CPU, Triton on CUDA) and compiles a small function, so a
  missing toolchain is a ConfigError at the start of the run, not a failure in its first step.
- `describe_compute`: the record of all three (compute.json in a run), with the attention route
  and the loss route `tunelab.stages.train.losses.check_model` chose and why.

`check_compile(device)`, `compile_blocks(model)`, `prepare_model(model, cfg, device) -> blocks`
(`build.build_model` calls it, before any wrapping), `compiled_blocks(model)`,
`describe_compute(model, cfg, device, input_ids, architecture)`. Config: `training.precision:
auto | fp32 | bf16 | fp16`, `training.compile: bool` (false), `training.attention: auto |
flash_varlen | torch_varlen | flex | per_example`.
"""

from __future__ import annotations

from typing import Any

import torch

from tunelab.core.errors import ConfigError
from tunelab.stages.train.precision import precision_choice


def check_compile(device: torch.device | str) -> None:
    """Raise ConfigError when torch.compile cannot build kernels for `device` here."""
    device = torch.device(device)
    hint = "install it, or set training.compile: false"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                "training.compile: torch.compile on CUDA needs Triton, which is not installed",
                hint=hint,
            )
    else:
        from torch._inductor import exc
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except exc.InvalidCxxCompiler as err:
            raise ConfigError(
                "training.compile: torch.compile on CPU needs a C++ compiler; none was found "
                "(g++, or the one $CXX names)",
                hint=hint,
            ) from err
    try:
        probe = torch.compile(_probe_function, fullgraph=True, dynamic=False)
        probe(torch.ones(8, device=device))
    except Exception as err:  # noqa: BLE001 - any failure to build means compile cannot be used
        raise ConfigError(
            f"training.compile: torch.compile failed on a small function: "
            f"{type(err).__name__}: {str(err)[:300]}",
            hint="set training.compile: false, or repair the compiler toolchain",
        ) from err


def _probe_function(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each block of `model` in place (the blocks FSDP shards one by one); returns how
    many. Raises ConfigError when the model has no blocks to compile."""
    from tunelab.stages.train.parallel import decoder_layers

    blocks = decoder_layers(model)
    if not blocks:
        raise ConfigError(
            f"training.compile: {type(model).__name__} has no list of blocks to compile",
            hint="set training.compile: false",
        )
    for block in blocks:
        block.compile()
    return len(blocks)


def prepare_model(model: torch.nn.Module, cfg: Any, device: torch.device | str) -> int:
    """Compile the blocks when `cfg.compile` (a TrainingConfig) asks, after checking the
    toolchain; before the model is wrapped for DDP or FSDP. Returns the blocks compiled."""
    if not getattr(cfg, "compile", False):
        return 0
    check_compile(device)
    return compile_blocks(model)


def compiled_blocks(model: torch.nn.Module) -> int:
    """How many modules of `model` run a compiled forward (`nn.Module.compile`)."""
    return sum(1 for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None)


def describe_compute(
    model: torch.nn.Module,
    cfg: Any,
    device: torch.device,
    input_ids: torch.Tensor,
    architecture: str,
) -> dict[str, Any]:
    """Run the model checks of `tunelab.stages.train.losses` in the training's precision (causal LM)
    and return the record: precision (requested, used, why), compile, attention and loss."""
    precision, why = precision_choice(cfg.precision, device)
    record: dict[str, Any] = {
        "device": str(device),
        "precision": {"requested": cfg.precision, "used": precision, "why": why},
        "compile": {"enabled": bool(cfg.compile), "blocks": compiled_blocks(model)},
    }
    if architecture == "causal_lm":
        from tunelab.stages.train.loop import autocast
        from tunelab.stages.train.losses import check_model

        with autocast(precision, device):
            checks = check_model(model, input_ids.to(device), getattr(cfg, "attention", "auto"))
        record.update(checks.describe())
    return record


def describe_load(strategy: Any) -> dict[str, Any]:
    """How the ranks of a distributed run loaded the base: `weights_load` with the mode
    (sharded: each rank read its own rows; whole: every rank loaded the base) and each rank's
    bytes read from the weight files. Empty for a single process. A collective."""
    if strategy.world_size == 1:
        return {}
    read = getattr(strategy, "bytes_read", None)
    per_rank = strategy.gather_objects(read)
    mode = "sharded" if read is not None else "whole"
    return {"weights_load": {"mode": mode, "bytes_read_per_rank": per_rank}}
