"""The terms of the memory model (`tunelab.stages.sizing.memory`): what it is told about a
model and its adaptation (`ModelFacts`), about one step (`Case`), what it answers (`Estimate`),
and the byte tables it counts with (dtypes, optimizer states, 4-bit blocks, block roles).

Values only, no torch: `tunelab.stages.sizing.facts` fills a `ModelFacts` from a live model,
`tunelab.stages.plan.shapes` from a config.json alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int8": 1, "uint8": 1}
# Optimizer states kept per trainable parameter, in the parameter's dtype.
OPTIMIZER_STATES = {
    "AdamW": 2,
    "Adam": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "Adadelta": 2,
    "SGD": 0,
    "ASGD": 2,
    "Rprop": 2,
    "LBFGS": 2,
}
# bitsandbytes' 8-bit optimizers: states per trainable parameter, one byte each, plus one fp32
# absmax per block of 256 (tensors under 4096 elements keep 32-bit states; not modelled).
EIGHT_BIT_STATES = {"AdamW8bit": 2, "PagedAdamW8bit": 2}
EIGHT_BIT_BLOCK = 256
# bitsandbytes' 4-bit weights (QLoRA): two per byte, one absmax per block of 64 weights (fp32;
# with double quantization a uint8 per block plus, per 256 of those, one fp32 absmax, and a
# 256-entry fp32 code table and an offset per tensor) and a 16-entry fp32 code per tensor.
QUANT_BLOCK = 64
QUANT_BLOCK2 = 256
# Roles of the parameters of one transformer block.
LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down")
NORM_ROLES = ("norm1", "norm2")
CONV_FAMILIES = ("resnet", "convnext")  # image models without tokens: walked map by map
FAMILIES = ("llama", "bert", *CONV_FAMILIES)


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs to know about a model and its adaptation (`tunelab.stages.sizing.facts.model_facts` fills it).

    `layer_training[i]` maps a role of block i (q k v o gate up down norm1 norm2) to "weight"
    (the weight trains), "lora" (a LoRA adapter trains beside the frozen weight) or is absent
    (frozen). `embed`, `final_norm`, `pooler` and `head` are "weight", "lora" or None.
    """

    family: str
    architecture: str  # "causal_lm" | "encoder"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_labels: int = 0
    tied_embeddings: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    param_dtype: str = "float32"
    weight_bytes: dict[str, int] = field(default_factory=dict)
    num_params: int = 0
    trainable_params: int = 0
    trainable_bytes: int = 0
    largest_trainable_bytes: int = 0
    layer_training: tuple[dict[str, str], ...] = ()
    lora_rank: int = 0
    lora_dropout: float = 0.0
    embed: str | None = None
    final_norm: str | None = None
    pooler: str | None = None
    head: str | None = None
    approximate: bool = False
    # QLoRA: the block linear layers stored in 4 bits (their packed bytes are in weight_bytes
    # as uint8); the constants that dequantize them; the weights of the largest such layer,
    # dequantized whole for each of its matmuls into quant_dtype (the dtype it was quantized
    # from), then cast to quant_compute_dtype
    quant_params: int = 0
    quant_tensors: int = 0
    quant_constant_bytes: int = 0
    quant_largest: int = 0
    quant_dtype: str = "float32"
    quant_compute_dtype: str = "bfloat16"
    # a conv net (family resnet | convnext): its config (image_size, num_channels, hidden_sizes,
    # depths, ...) and "trains": module path (as in the model, no prefix) -> "weight" | "lora"
    conv: dict[str, Any] | None = None
    # a mixture-of-experts model: tunelab.lib.models.moe.MoeShape.to_dict() (experts, top_k,
    # expert_intermediate, shared_intermediate, sparse_layers, ...); its sparse blocks carry the
    # roles "experts", "router" and "shared" (tunelab.stages.sizing.moe_walk)
    moe: dict[str, Any] | None = None
    # a hierarchical vision transformer (Swin): per stage {depth, hidden, heads, grid, window,
    # intermediate} (tunelab.stages.sizing.stage_walk); `layers` counts the blocks of all
    stages: list[dict[str, int]] | None = None

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.weight_bytes.values()) + self.quant_constant_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_training"] = [dict(x) for x in self.layer_training]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelFacts:
        d = dict(d)
        d["layer_training"] = tuple(dict(x) for x in d.get("layer_training", ()))
        return cls(**d)


@dataclass(frozen=True)
class Case:
    """One step configuration: every example of the micro-batch is `seq_len` tokens long.

    `loss_fraction`: share of the positions that carry loss (causal LM; the rest is prompt).
    `packing`: the micro-batch is one row of micro_batch * seq_len tokens; attention runs once
    per example (tunelab.stages.train.attention), so no mask, and the examples' outputs are copied.
    `masked`: padded rows need an attention mask (unequal lengths); equal lengths need none.
    """

    seq_len: int
    micro_batch: int
    grad_accum: int = 1
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast over the param dtype)
    checkpointing: bool = False
    packing: bool = False
    masked: bool = False
    loss_fraction: float = 1.0
    optimizer: str = "AdamW"
    device: str = "cpu"  # cpu | cuda (attention kernels and dropout masks differ)
    cuda_major: int = 9  # compute capability: the cuBLAS workspace size depends on it

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch


@dataclass
class Estimate:
    """Predicted bytes. `peak_total` is everything alive at the peak; `peak_increase` the part a
    training step adds to a process holding the weights and the batch (what CPU RSS shows)."""

    weights: int
    weights_by_dtype: dict[str, int]
    gradients: int
    optimizer_states: int
    activations: int
    activations_detail: dict[str, int]
    logits_loss: int
    backward_temporaries: int
    optimizer_temporaries: int
    peak_phase: str
    phases: dict[str, int]
    peak_total: int
    peak_increase: int
    rule_x4: int
    approximate: bool = False
    notes: list[str] = field(default_factory=list)
    dequantized_layer: int = 0  # QLoRA: the largest 4-bit layer dequantized for its matmul

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
