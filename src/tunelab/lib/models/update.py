"""The update check: after the first steps every trainable tensor moved and no frozen one did.

`capture_params` before the first optimizer step; `check_update` after step k. LoRA B starts at
zero, so LoRA A receives a zero gradient on step 1 and only moves from step 2 on (for LoRA on
embeddings the roles swap: lora_embedding_A starts at zero).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FULL_COPY_LIMIT_BYTES = 256 * 2**20
SAMPLE_SIZE = 4096


class ParamSnapshot(dict):
    """name -> copy (or fingerprint) of every parameter, and which ones are meant to train."""

    trainable: frozenset[str]
    fingerprinted: frozenset[str]


def _unwrap(model: Any) -> Any:
    # DistributedDataParallel prefixes names with "module."; compare the inner model.
    while type(model).__name__ == "DistributedDataParallel":
        model = model.module
    return model


def _local(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A small summary of a tensor that changes when any element does.

    CPU: CRC-32 of its bytes (any bit flip shows; as fast as a copy, without the memory).
    Accelerators: float64 sum and norm plus an evenly strided sample, computed on the device.
    """
    import torch

    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu":
        data = flat.contiguous().view(torch.uint8).numpy()
        return torch.tensor([zlib.crc32(data), flat.numel()], dtype=torch.int64)
    step = max(1, flat.numel() // SAMPLE_SIZE)
    sample = flat[::step][:SAMPLE_SIZE].to(torch.float64)
    stats = torch.stack(
        [flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, dtype=torch.float64)]
    )
    return torch.cat([stats, sample]).cpu()


def capture_params(model: Any, *, full_copy_limit_bytes: int = FULL_COPY_LIMIT_BYTES):
    """The state of every parameter before training, for `check_update`.

    Trainable and frozen tensors are copied, or, when the set's total exceeds
    `full_copy_limit_bytes` (a big frozen base; full fine-tuning of a big model), kept as
    fingerprints. The trainable set is what `adapt` meant to train when known, else
    `requires_grad`.
    """
    import torch

    model = _unwrap(model)
    params = dict(model.named_parameters())
    expected = getattr(model, "tunelab_expected_trainable", None)
    trainable = (
        frozenset(expected)
        if expected is not None
        else frozenset(n for n, p in params.items() if p.requires_grad)
    )

    def set_bytes(names: set[str]) -> int:
        return sum(params[n].numel() * params[n].element_size() for n in names)

    frozen = set(params) - trainable
    summarize = {
        "trainable": set_bytes(trainable & set(params)) > full_copy_limit_bytes,
        "frozen": set_bytes(frozen) > full_copy_limit_bytes,
    }
    snap = ParamSnapshot()
    fingerprinted = set()
    with torch.no_grad():
        for name, p in params.items():
            t = _local(p)
            if summarize["trainable" if name in trainable else "frozen"]:
                snap[name] = fingerprint(t)
                fingerprinted.add(name)
            else:
                snap[name] = t.clone()
    snap.trainable = trainable
    snap.fingerprinted = frozenset(fingerprinted)
    return snap


def _moves_late(name: str) -> bool:
    """LoRA tensors whose gradient is zero on step 1 (their partner starts at zero)."""
    return ".lora_A." in name or ".lora_embedding_B." in name


def check_update(before: ParamSnapshot, model: Any, step: int, method: str) -> list[str]:
    """Violations after `step` optimizer steps (empty when the update is as expected).

    Each string names a tensor: trainable but unchanged, meant to train but frozen, or frozen but
    changed. LoRA A tensors may stay unchanged while step < 2.
    """
    import torch

    model = _unwrap(model)
    params = dict(model.named_parameters())
    out = []
    with torch.no_grad():
        for name, old in before.items():
            p = params.get(name)
            if p is None:
                out.append(f"{name}: tensor disappeared from the model")
                continue
            now = _local(p)
            if name in before.fingerprinted:
                changed = not torch.equal(fingerprint(now), old)
            else:
                changed = not torch.equal(now, old)
            if name in before.trainable:
                if not p.requires_grad:
                    out.append(f"{name}: meant to train but requires_grad is False")
                elif not changed and not (
                    method in ("lora", "qlora") and step < 2 and _moves_late(name)
                ):
                    out.append(f"{name}: trainable but unchanged after {step} step(s)")
            elif changed:
                out.append(f"{name}: frozen but changed after {step} step(s)")
    return out
