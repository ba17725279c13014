"""Linear layers with their weights packed for oneDNN: the evaluation copy's CPU decoding.

On a CPU, torch's dense `linear` reads an fp32 (out, in) weight well below the memory bandwidth
when only a few rows pass through it, as every decoding step does; the same weight reordered once
into oneDNN's blocked layout (what torch.compile's CPU freezing and IPEX do) is read several
times faster, and decoding is mostly reading weights. The sums are reordered, so a packed copy is
adopted only through the evaluation's first-batch check (`tunelab.lib.inference.eval_copy`), like a merge.
"""

from __future__ import annotations

from typing import Any

import torch

PACKED_DTYPES = ("float32",)


def packing_unavailable(model: Any) -> str | None:
    """Why the linear layers of `model` are not packed (None when they are packable)."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch has no packed linear kernel"
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    if not weights:
        return "the model has no linear layer"
    if any(w.device.type != "cpu" for w in weights):
        return "the model is not on the CPU"
    dtypes = {str(w.dtype).removeprefix("torch.") for w in weights}
    if not dtypes <= set(PACKED_DTYPES):
        return f"linear weights in {', '.join(sorted(dtypes))}, packed only in float32"
    return None


def packed_bytes(model: Any) -> int:
    """The bytes the packed weights of `model`'s linear layers take (one more copy of each)."""
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if type(m) is torch.nn.Linear
    )


class PackedLinear(torch.nn.Module):
    """Stands in for an `nn.Linear` at inference: its weight reordered for oneDNN once."""

    def __init__(self, linear: torch.nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # a plain attribute: an opaque oneDNN tensor has no storage to copy, move or save
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: Any, rows: int) -> int:
    """Replace every `nn.Linear` of `model` (in place) by a packed one; `rows` is the number of
    rows a decoding step passes (the batch), the layout's hint. Returns how many were packed.
    Every weight is packed before any layer is replaced: a kernel that refuses one (an error
    raised) leaves the model as it was."""
    swaps = [
        (module, name, PackedLinear(child, rows))
        for module in list(model.modules())
        for name, child in list(module.named_children())
        if type(child) is torch.nn.Linear
    ]
    for module, name, packed in swaps:
        setattr(module, name, packed)
    return len(swaps)
