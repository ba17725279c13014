"""The update check: after the first steps every trainable tensor moved and no frozen one did.

`capture_params` before the first optimizer step; `check_update` after step k. LoRA B starts at
zero, so LoRA A receives a zero gradient on step 1 and only moves from step 2 on (for LoRA on
embeddings the roles swap: lora_embedding_A starts at zero).
"""

from __future__ import annotations

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
    """A cheap summary of a tensor: float64 sum and norm plus an evenly strided sample."""
    import torch

    flat = t.reshape(-1)
    step = max(1, flat.numel() // SAMPLE_SIZE)
    sample = flat[::step][:SAMPLE_SIZE].to(torch.float64)
    stats = torch.stack(
        [flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, dtype=torch.float64)]
    )
    return torch.cat([stats, sample])


def capture_params(model: Any, *, full_copy_limit_bytes: int = FULL_COPY_LIMIT_BYTES):
    """Copies of trainable tensors, and of frozen ones (fingerprints when they are large).

    The trainable set is what `adapt` meant to train when known, else `requires_grad`.
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
    frozen_bytes = sum(
        p.numel() * p.element_size() for n, p in params.items() if n not in trainable
    )
    use_fingerprint = frozen_bytes > full_copy_limit_bytes
    snap = ParamSnapshot()
    fingerprinted = set()
    with torch.no_grad():
        for name, p in params.items():
            t = _local(p)
            if name not in trainable and use_fingerprint:
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
                elif not changed and not (method == "lora" and step < 2 and _moves_late(name)):
                    out.append(f"{name}: trainable but unchanged after {step} step(s)")
            elif changed:
                out.append(f"{name}: frozen but changed after {step} step(s)")
    return out
