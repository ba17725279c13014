"""`training.precision`: what each value computes in on a device.

`auto` (the default) is bf16 autocast on a CUDA device that supports bf16 and fp32 elsewhere
(CPU; a GPU without bf16, where fp16 needs its grad scaler and is asked for by name). fp32, bf16
and fp16 mean what they say. Every reader of training.precision resolves it here.

`resolve_precision(requested, device) -> "fp32" | "bf16" | "fp16"`; `precision_choice` adds the
reason; `refused_here` is what `tunelab validate` warns of on a machine that cannot train it. Its readers: `loop.autocast`, `make_grad_scaler`, the strategies, the smoke's
tolerances, the sizing's options; `tunelab verify` takes the precision a run used from its
compute.json.
"""

from __future__ import annotations

import torch


def resolve_precision(requested: str, device: torch.device | str) -> str:
    """ "fp32" | "bf16" | "fp16" for `requested` (which may be "auto") on `device`."""
    return precision_choice(requested, torch.device(device))[0]


def precision_choice(requested: str, device: torch.device) -> tuple[str, str]:
    """(precision, why) for `requested` on `device`: the reason compute.json records."""
    if requested != "auto":
        return requested, "training.precision"
    if device.type != "cuda":
        return "fp32", "auto: fp32 on CPU (bf16 autocast is slower on CPUs without bf16 units)"
    name = torch.cuda.get_device_name(device)
    if torch.cuda.is_bf16_supported():
        return "bf16", f"auto: bf16 autocast, supported by {name}"
    return (
        "fp32",
        f"auto: {name} has no bf16; fp16 (with a grad scaler) is training.precision: fp16",
    )


def refused_here(requested: str) -> str | None:
    """Why `tunelab train` on this machine would refuse `training.precision`, or None."""
    from tunelab.core.env import device_kind

    if requested == "fp16" and device_kind() != "cuda":
        return (
            "training.precision: fp16 needs a CUDA device (it trains with a grad scaler); "
            "`tunelab train` on this machine refuses it, a GPU node trains it"
        )
    return None
