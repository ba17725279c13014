"""The memory of loading the base, before the first step: per rank and per node, device and host.

A layout whose training step fits can still die at load, after the rental is paid for. How
tunelab's trainer loads (tunelab.stages.train.build):

- one process, DDP, and FSDP of a model it cannot load sharded (an encoder or image model, a
  4-bit base): every rank loads the whole base into host memory (transformers reads the
  safetensors files tensor by tensor into the model) and moves it whole to its device; FSDP
  shards it only after that. Device: the whole weights per rank. Host: the whole weights per
  rank, so N copies on a node of N ranks.
- FSDP of a causal LM in full precision: sharded loading (the model built without storage, each
  rank reading only its rows). Device: 1/N of the weights. Host: the rows of one tensor in
  flight, plus the adapter's new tensors whole (built on every rank, then sharded); on a CPU
  "device" the shards themselves live in host memory too.

`load_peak` is pure: facts in, bytes out. The plan, the sizing and `validate --nproc` compare
it with the GPU's memory (device) and the machine's (host).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tunelab.stages.sizing.memory import DTYPE_BYTES, ModelFacts


@dataclass(frozen=True)
class LoadPeak:
    """Bytes alive while loading, per rank and per node of `ranks_per_node` ranks."""

    mode: str  # "whole" | "sharded"
    device_per_rank: int
    host_per_rank: int
    host_per_node: int
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loads_sharded(facts: ModelFacts, strategy: str) -> bool:
    """Whether the trainer loads this model sharded (see the module docstring)."""
    return strategy == "fsdp" and facts.architecture == "causal_lm" and not facts.quant_params


def _largest_tensor_bytes(facts: ModelFacts) -> int:
    pb = DTYPE_BYTES.get(facts.param_dtype, 4)
    return max(facts.vocab * facts.hidden, facts.intermediate * facts.hidden) * pb


def load_peak(
    facts: ModelFacts,
    strategy: str = "single",
    ranks: int = 1,
    ranks_per_node: int | None = None,
    device: str = "cuda",
) -> LoadPeak:
    """The load-time peak of `facts` under `strategy` over `ranks` ranks (`ranks_per_node` of
    them on each node, all by default); `device` "cpu" puts the device's bytes in host memory."""
    ranks = max(1, ranks)
    per_node = min(ranks, ranks_per_node or ranks)
    weights = facts.total_weight_bytes
    gb = weights / 1e9
    if loads_sharded(facts, strategy) and ranks > 1:
        on_device = weights // ranks + facts.trainable_bytes // ranks
        in_flight = _largest_tensor_bytes(facts) // ranks + facts.trainable_bytes
        host = in_flight + (on_device if device == "cpu" else 0)
        why = f"sharded loading: each rank reads its 1/{ranks} of the {gb:.1f} GB of weights"
        return LoadPeak("sharded", on_device, host, host * per_node, why)
    host = weights
    if strategy == "fsdp" and ranks > 1:
        why = (
            f"the whole base ({gb:.1f} GB of weights) loads on every rank and moves to its "
            "device before FSDP shards it (sharded loading covers causal LMs in full precision)"
        )
    else:
        why = f"the whole base ({gb:.1f} GB of weights) loads on every rank"
    return LoadPeak("whole", weights, host, host * per_node, why)


def load_problem(peak: LoadPeak, device_bytes: int | None, host_bytes: int | None) -> str | None:
    """Why the load cannot fit (the device's or the node's memory), or None when it can; a
    capacity of None is not checked."""
    if device_bytes is not None and peak.device_per_rank > device_bytes:
        return (
            f"loading does not fit: {peak.device_per_rank / 1e9:.1f} GB on each device, over "
            f"its {device_bytes / 1e9:.1f} GB ({peak.why})"
        )
    if host_bytes is not None and peak.host_per_node > host_bytes:
        return (
            f"loading does not fit: {peak.host_per_node / 1e9:.1f} GB of host memory on the "
            f"node, over its {host_bytes / 1e9:.1f} GB ({peak.why})"
        )
    return None
