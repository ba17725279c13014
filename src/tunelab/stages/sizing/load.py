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
it with the GPU's memory (device) and the machine's (host), and with it the evaluation's peak on
one device (`peaks.evaluation_refusal`): whatever the training layout, `tunelab eval` loads the
whole model on one device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tunelab.stages.sizing.terms import DTYPE_BYTES, ModelFacts


@dataclass(frozen=True)
class LoadPeak:
    """Bytes alive while loading, per rank and per node of `ranks_per_node` ranks."""

    mode: str  # "whole" | "sharded"
    device_per_rank: int
    host_per_rank: int
    host_per_node: int
    weights: int  # the base's weights, all ranks together
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loads_sharded(facts: ModelFacts, strategy: str) -> bool:
    """Whether the trainer loads this model sharded (see the module docstring)."""
    return strategy == "fsdp" and facts.architecture == "causal_lm" and not facts.quant_params


def strategy_refusal(facts: ModelFacts, strategy: str, precision: str) -> str | None:
    """Why `tunelab train` refuses this model under `strategy` (the rules of
    `tunelab.stages.train.parallel.strategy_problems`, read from the facts), or None."""
    if strategy != "fsdp":
        return None
    if facts.quant_params:
        return "tunelab train refuses qlora under fsdp (FSDP would split the 4-bit weights)"
    if facts.conv:  # FSDP wraps transformer blocks, one by one
        return "tunelab train shards transformer blocks under fsdp: a conv net has none"
    if precision == "fp16":
        return "tunelab train refuses fp16 under fsdp (use bf16)"
    return None


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
        why = f"sharded loading: each rank reads its 1/{ranks} of the weights {gb:.1f} GB"
        return LoadPeak("sharded", on_device, host, host * per_node, weights, why)
    why = f"weights {gb:.1f} GB, loaded whole on every rank"
    if strategy == "fsdp" and ranks > 1:
        why += (
            " and moved to its device before FSDP shards them (sharded loading covers causal "
            "LMs in full precision)"
        )
    return LoadPeak("whole", weights, weights, weights * per_node, weights, why)


def load_problem(peak: LoadPeak, device_bytes: int | None, host_bytes: int | None) -> str | None:
    """Why the load cannot fit (the device's or the node's memory), or None when it can; a
    capacity of None is not checked."""
    if device_bytes is not None and peak.device_per_rank > device_bytes:
        return (
            f"the load does not fit: {peak.device_per_rank / 1e9:.1f} GB on each GPU, over "
            f"its {device_bytes / 1e9:.1f} GB ({peak.why})"
        )
    if host_bytes is not None and peak.host_per_node > host_bytes:
        return (
            f"the load does not fit: {peak.host_per_node / 1e9:.1f} GB of host memory on the "
            f"node, over its {host_bytes / 1e9:.1f} GB ({peak.why})"
        )
    return None


def load_table(
    facts: ModelFacts,
    ranks: tuple[int, ...],
    budget_bytes: int | None,
    device: str,
    evaluation: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The load of one process and of each rank count in `ranks` under DDP and FSDP (all ranks
    on one node), each with its problem against `budget_bytes` (a GPU's memory on "cuda", the
    node's memory on "cpu"; None: not checked). `tunelab size` records and prints it.

    `evaluation` (the sizing's `evaluation_peak`): every layout evaluates on one device
    (`tunelab eval` loads the whole model there), so a layout that loads is still refused when
    that peak is over the budget (`peaks.evaluation_refusal`)."""
    from tunelab.stages.sizing.peaks import evaluation_refusal, peak_total

    on_gpu = device == "cuda"
    evaluation_bytes = peak_total(evaluation)
    rows = []
    for n in (1, *sorted({r for r in ranks if r > 1})):
        for strategy in ("single",) if n == 1 else ("ddp", "fsdp"):
            peak = load_peak(facts, strategy, n, n, device)
            problem = load_problem(
                peak, budget_bytes if on_gpu else None, None if on_gpu else budget_bytes
            )
            if problem is None and evaluation_bytes and budget_bytes and evaluation:
                problem = evaluation_refusal(
                    evaluation_bytes, budget_bytes, evaluation["settings"],
                    facts.total_weight_bytes, device="GPU" if on_gpu else "machine",
                )  # fmt: skip
            rows.append({"ranks": n, "strategy": strategy, **peak.to_dict(), "problem": problem})
    return rows
