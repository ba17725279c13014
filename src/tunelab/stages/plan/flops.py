"""FLOPs of a training step and of an evaluation, from the model's shape: pure arithmetic.

A linear layer of `fan_in x fan_out` costs 2 FLOPs per weight per token forward; backward costs
as much again for the gradient of its input (needed wherever something below it trains) and as
much again for the gradient of its weight (when the weight trains). So full fine-tuning costs 6
FLOPs per parameter per token, and LoRA on a frozen base about 4 (input gradients only) plus 6
per adapter parameter. Attention's two products cost 4 x heads x head_dim FLOPs per (query, key)
pair forward, twice that backward. tunelab's loss runs the LM head on the loss positions only
(`tunelab.stages.train.losses`), so the head counts at those positions. Activation checkpointing runs
each block's forward again during backward. A ResNet or ConvNeXt costs 2 FLOPs per multiply of
each convolution and linear layer, counted by the memory model's walk of its feature maps.

`micro_step_flops(facts, MicroBatch, checkpointing)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunelab.stages.sizing.terms import ModelFacts
from tunelab.stages.sizing.walk import conv_flops

_LLAMA_ROLES = ("q", "k", "v", "o", "gate", "up", "down")
_BERT_ROLES = ("q", "k", "v", "o", "up", "down")


def linear_shapes(facts: ModelFacts) -> dict[str, tuple[int, int]]:
    """(fan_in, fan_out) of each linear role of one block."""
    h, hd = facts.hidden, facts.head_dim
    q, kv = facts.heads * hd, facts.kv_heads * hd
    if facts.family == "bert":
        return {
            "q": (h, h),
            "k": (h, h),
            "v": (h, h),
            "o": (h, h),
            "up": (h, facts.intermediate),
            "down": (facts.intermediate, h),
        }
    return {
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "gate": (h, facts.intermediate),
        "up": (h, facts.intermediate),
        "down": (facts.intermediate, h),
    }


def block_linears(facts: ModelFacts, layer: int) -> list[tuple[str, int, int]]:
    """(role, fan_in, fan_out) of the matmuls one token runs through in block `layer`. A
    mixture-of-experts block's MLP is its router, `top_k` experts (each as wide as one expert,
    folded into one matmul of top_k times the width) and the shared experts: the active
    parameters, not the resident ones."""
    shapes = linear_shapes(facts)
    moe = facts.moe
    if not moe or layer not in moe["sparse_layers"]:
        return [(role, i, o) for role, (i, o) in shapes.items()]
    h, width, k = facts.hidden, int(moe["expert_intermediate"]), int(moe["top_k"])
    out = [(role, *shapes[role]) for role in ("q", "k", "v", "o")]
    out += [("router", h, int(moe["experts"]))]
    out += [("experts", h, 2 * width * k), ("experts", width * k, h)]
    shared = int(moe.get("shared_intermediate") or 0)
    if shared:
        out += [("shared", h, 2 * shared), ("shared", shared, h)]
    return out


@dataclass(frozen=True)
class MicroBatch:
    """The tokens of one micro-batch as the step computes them.

    `tokens`: positions computed (padding included); `attention_pairs`: (query, key) pairs the
    attention computes over all its rows; `head_tokens`: positions the output head runs on (the
    loss positions of a causal LM, one per example for a classifier)."""

    tokens: float
    attention_pairs: float
    head_tokens: float
    examples: int


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-step, by part."""

    forward: float
    backward: float
    recompute: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def _first_trainable_block(facts: ModelFacts) -> int | None:
    if facts.embed:
        return 0
    for i, roles in enumerate(facts.layer_training):
        if roles:
            return i
    return None


def _head_size(facts: ModelFacts) -> int:
    """Weights the output head multiplies per head position."""
    if facts.architecture == "causal_lm":
        return facts.hidden * facts.vocab
    pooler = facts.hidden * facts.hidden
    return pooler + facts.hidden * max(1, facts.num_labels)


def micro_step_flops(facts: ModelFacts, batch: MicroBatch, *, checkpointing: bool) -> StepFlops:
    """FLOPs of one forward and backward of `batch` (see the module docstring); a conv net's
    from its feature-map walk over `batch.examples` images (`conv_flops`)."""
    if facts.conv is not None:
        forward, backward = conv_flops(facts, batch.examples)
        return StepFlops(forward, backward, 0.0)  # neither conv net checkpoints
    first = _first_trainable_block(facts)
    forward = backward = recompute = 0.0
    for i in range(facts.layers):
        roles = facts.layer_training[i] if i < len(facts.layer_training) else {}
        block = 0.0
        for role, fan_in, fan_out in block_linears(facts, i):
            dense = 2 * batch.tokens * fan_in * fan_out
            block += dense
            needs_input = first is not None and i >= first
            backward += dense * (
                (1 if needs_input else 0) + (1 if roles.get(role) == "weight" else 0)
            )
            if roles.get(role) == "lora":
                lora = 2 * batch.tokens * facts.lora_rank * (fan_in + fan_out)
                block += lora
                backward += 2 * lora  # the adapter's input and weight gradients
        attention = 4 * facts.heads * facts.head_dim * batch.attention_pairs
        block += attention
        if first is not None and i >= first:
            backward += 2 * attention
            if checkpointing:
                recompute += block
        forward += block
    head = 2 * batch.head_tokens * _head_size(facts)
    forward += head
    if first is not None:
        backward += head  # the gradient of the blocks' output
    if facts.head == "weight":
        backward += head
    return StepFlops(forward, backward, recompute)


def forward_flops(facts: ModelFacts, batch: MicroBatch) -> float:
    """FLOPs of an inference forward (no backward, no recompute)."""
    return micro_step_flops(facts, batch, checkpointing=False).forward


def weight_bytes_read(facts: ModelFacts, compute_bytes: int) -> float:
    """Bytes of weights a decoding step reads (each parameter once, in the compute dtype)."""
    return facts.num_params * compute_bytes


def kv_cache_bytes(facts: ModelFacts, rows: int, context: float, compute_bytes: int) -> float:
    """Bytes of keys and values a decoding step reads for `rows` sequences of `context` tokens."""
    return 2 * facts.layers * facts.kv_heads * facts.head_dim * rows * context * compute_bytes
