"""The update check: after the first steps every trainable tensor moved and no frozen one did.

`capture_params` before the first optimizer step; `check_update` after step k. LoRA B starts at
zero, so LoRA A receives a zero gradient on step 1 and only moves from step 2 on (for LoRA on
embeddings the roles swap: lora_embedding_A starts at zero).

Two kinds of "trainable but unchanged" are told apart by a hook that notes every tensor autograd
gives a gradient to:
- received no gradient: the task's forward does not use the tensor (DINOv2's `mask_token`, an
  unused pooler, a pre-training head) or, under an `experts` module, no token was routed to that
  expert in these steps. Reported, not a failure: `unused` (excluded from the trainable count)
  and `unrouted` (still trainable: another batch routes to it).
- received a gradient and did not move: the failure the check exists for (an optimizer that
  skips the tensor, a learning rate of zero, a broken scaler).
Where no hook fires at all (FSDP2 assigns sharded gradients directly) every tensor is taken as
having received one, which is the strict reading.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FULL_COPY_LIMIT_BYTES = 256 * 2**20
SAMPLE_SIZE = 4096


class ParamSnapshot(dict):
    """name -> copy (or fingerprint) of every parameter, which ones are meant to train, and the
    trainable ones autograd gave a gradient to since the capture."""

    trainable: frozenset[str]
    fingerprinted: frozenset[str]
    got_grad: set[str]
    hooks: list[Any]
    numel: dict[str, int]

    def release(self) -> None:
        """Remove the gradient hooks (after the check: training needs them no longer)."""
        for hook in getattr(self, "hooks", []):
            hook.remove()
        self.hooks = []


@dataclass
class UpdateResult:
    """What `classify_update` found: failures, and the tensors unchanged for a reason."""

    violations: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # no gradient: the forward skips them
    unrouted: list[str] = field(default_factory=list)  # experts no token was routed to
    unused_numel: int = 0


def is_expert(name: str) -> bool:
    """A tensor of a mixture-of-experts expert (per-expert modules or fused expert tensors)."""
    return ".experts." in name


def _watch_gradients(params: dict[str, Any], names: frozenset[str]) -> tuple[set[str], list]:
    got: set[str] = set()
    hooks = []
    for name in names:
        p = params.get(name)
        if p is None or not p.requires_grad or not hasattr(p, "register_post_accumulate_grad_hook"):
            continue
        hooks.append(p.register_post_accumulate_grad_hook(lambda _p, n=name: got.add(n)))
    return got, hooks


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
    snap.got_grad, snap.hooks = _watch_gradients(params, trainable)
    snap.numel = {n: params[n].numel() for n in trainable if n in params}
    return snap


def _moves_late(name: str) -> bool:
    """LoRA tensors whose gradient is zero on step 1 (their partner starts at zero)."""
    return ".lora_A." in name or ".lora_embedding_B." in name


def _still_experts(name: str, now: torch.Tensor, old: torch.Tensor) -> list[str]:
    """A fused expert tensor ([experts, ...]) moved: the experts whose slice did not, which no
    token was routed to (a zero gradient leaves an Adam update at zero)."""
    import torch

    if now.dim() < 2:
        return []
    still = [e for e in range(now.shape[0]) if torch.equal(now[e], old[e])]
    return [f"{name}[{','.join(map(str, still))}]"] if still else []


def check_update(before: ParamSnapshot, model: Any, step: int, method: str) -> list[str]:
    """Violations after `step` optimizer steps (empty when the update is as expected); see
    `classify_update` for the tensors unchanged for a reason."""
    return classify_update(before, model, step, method).violations


def classify_update(before: ParamSnapshot, model: Any, step: int, method: str) -> UpdateResult:
    """Each tensor after `step` optimizer steps: a violation names one trainable but unchanged
    although it received a gradient, meant to train but frozen, or frozen but changed; a
    trainable one that received no gradient is `unused` (or `unrouted` under `experts`). LoRA A
    tensors may stay unchanged while step < 2."""
    import torch

    got_grad = getattr(before, "got_grad", set())
    hooks_fired = bool(got_grad)
    model = _unwrap(model)
    params = dict(model.named_parameters())
    out = UpdateResult()
    with torch.no_grad():
        for name, old in before.items():
            p = params.get(name)
            if p is None:
                out.violations.append(f"{name}: tensor disappeared from the model")
                continue
            now = _local(p)
            if name in before.fingerprinted:
                changed = not torch.equal(fingerprint(now), old)
            else:
                changed = not torch.equal(now, old)
            if name not in before.trainable:
                if changed:
                    out.violations.append(f"{name}: frozen but changed after {step} step(s)")
            elif not p.requires_grad:
                out.violations.append(f"{name}: meant to train but requires_grad is False")
            elif changed:
                if is_expert(name) and name not in before.fingerprinted:
                    out.unrouted += _still_experts(name, now, old)
            elif method in ("lora", "qlora") and step < 2 and _moves_late(name):
                continue
            elif hooks_fired and name not in got_grad:
                if is_expert(name):
                    out.unrouted.append(name)
                else:
                    out.unused.append(name)
                    out.unused_numel += before.numel.get(name, p.numel())
            else:
                out.violations.append(
                    f"{name}: received a gradient but unchanged after {step} step(s)"
                )
    return out
