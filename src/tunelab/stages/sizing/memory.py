"""The analytic memory model of one training step: pure arithmetic over the architecture.

`estimate_memory(facts, case)` predicts, for one model, adaptation and step configuration:

- weights by dtype, gradients of the trainable parameters, optimizer states;
- activations: what autograd keeps for backward at the end of the forward pass. They are
  counted by walking the forward pass of one transformer block op by op (`_Trace`) with the
  rule autograd follows: an op keeps an input only when the gradient of another input needs it
  (a linear layer keeps its input only when its weight trains, a product `a * b` keeps `b` only
  when `a` needs a gradient). So LoRA on a frozen base keeps far less than full fine-tuning, and
  layers before the first trainable parameter keep almost nothing;
- the logits and loss buffers: tunelab's loss runs the head on the loss positions only
  (`tunelab.stages.train.losses`). A plain head is fused with the cross-entropy: chunks of 2^22
  logits (at least 256 rows), their gradients made in the forward pass, nothing of
  `[loss tokens, vocab]` kept for backward. A LoRA head runs in chunks recomputed in backward, and under DDP or FSDP
  the head runs inside the model's forward on all loss positions at once; and the temporaries
  of backward and of the optimizer;
- the peak: the largest of the forward end, the loss backward, the layer backward and the
  optimizer step, each with what is alive at that moment.

Two block families are walked: `llama` (pre-norm RMSNorm, RoPE, fused attention, gated SiLU MLP:
Llama, Mistral, Qwen2, SmolLM2) and `bert` (post-norm LayerNorm, GELU MLP, dropout). Other
transformers use the `llama` walk and are marked approximate. Two conv nets are walked feature
map by feature map, at the model's image size: `resnet` (convolution, batch norm, ReLU, max
pool, basic or bottleneck layers) and `convnext` (depthwise convolution, LayerNorm, pointwise
linear layers, layer scale). No torch import: values in, values out.

Interface: `ModelFacts`, `Case(seq_len, micro_batch, grad_accum, precision, checkpointing, packing,
masked, loss_fraction, optimizer, device)`, `estimate_memory(facts, case, strategy="single" | "ddp"
| "fsdp", ranks=1) -> Estimate` (bytes: `weights`, `gradients`, `optimizer_states`, `activations`,
`logits_loss`, `phases`, `peak_total`, `peak_increase`, `rule_x4`, `dequantized_layer`),
`project_per_rank(facts, case, n)`. `loss_route(facts, strategy) -> "fused" | "chunked" | "model"`
and `logits_bytes(facts, case, route="fused") -> {logits, loss_tokens, chunk_rows, kept, forward,
backward}` are the loss term, by the training loss's route. QLoRA: `ModelFacts.quant_params,
quant_tensors, quant_constant_bytes, quant_largest, quant_dtype, quant_compute_dtype` (0 / defaults
without a 4-bit base; `total_weight_bytes` includes the constants), `quant_constants_of(numels,
double_quant)`, `dequantized_layer_bytes(facts)`, `weights_by_dtype["4bit_constants"]`. Conv nets
(`CONV_FAMILIES`): `ModelFacts.conv` holds the config fields the walk reads and `trains` (module
path -> "weight" | "lora", the head as "classifier"); `Case.seq_len` is unused there (the side is
`conv["image_size"]`; the batch is `micro_batch` images).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from tunelab.stages.sizing import stage_walk

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
    """What the estimate needs to know about a model and its adaptation (see measure.model_facts).

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


# ------------------------------------------------------------------ the forward walk


_KEYS = itertools.count(1)  # tensor identities, unique across traces (a block re-traced shares x)


@dataclass(frozen=True)
class _T:
    """A symbolic tensor: element count, bytes per element, whether it needs a gradient."""

    key: int
    numel: int
    size: int
    rg: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.size


class _Trace:
    """Walks a forward pass op by op and records the tensors autograd saves for backward."""

    def __init__(self, facts: ModelFacts, case: Case, loss_route: str = "fused"):
        self.f = facts
        self.c = case
        self.loss_route = loss_route
        self.pb = DTYPE_BYTES.get(facts.param_dtype, 4)
        self.autocast = case.precision in ("bf16", "fp16")
        self.cd = 2 if self.autocast else self.pb  # dtype of matmul inputs and outputs
        self.cuda = case.device == "cuda"
        self.saved: dict[int, int] = {}
        self.groups: dict[str, int] = {}
        self._group = "embeddings"

    # tensors
    def new(self, numel: int, size: int, rg: bool) -> _T:
        return _T(next(_KEYS), int(numel), size, rg)

    def save(self, *ts: _T) -> None:
        for t in ts:
            if t.key not in self.saved:
                self.saved[t.key] = t.nbytes
                self.groups[self._group] = self.groups.get(self._group, 0) + t.nbytes

    def save_bytes(self, nbytes: int) -> None:
        self.save(self.new(nbytes, 1, False))

    def group(self, name: str) -> None:
        self._group = name

    @property
    def total(self) -> int:
        return sum(self.saved.values())

    # ops
    def cast(self, x: _T, size: int) -> _T:
        return x if x.size == size else self.new(x.numel, size, x.rg)

    def linear(
        self, x: _T, fan_in: int, fan_out: int, train: str | None, *, outside: bool = False
    ) -> _T:
        """x @ W.T (+ LoRA B(A(dropout(x))) * scale); x has x.numel // fan_in rows.

        A block's linear layer of a 4-bit base (QLoRA; `outside`: the head, never 4-bit) keeps
        only its packed weight for backward and returns x's dtype (bitsandbytes casts back)."""
        rows = x.numel // fan_in
        four_bit = self.f.quant_params > 0 and not outside
        xin = self.cast(x, self.cd) if self.autocast else x
        if train == "weight":
            self.save(xin)  # grad W = g.T @ x
        if self.autocast and x.rg and not four_bit and self.pb != self.cd:
            # the low-precision weight copy (weights already in the compute dtype need none)
            self.save_bytes(fan_in * fan_out * self.cd)
        out_size = self.cd if self.autocast else max(self.pb, x.size if train else self.pb)
        out = self.new(rows * fan_out, x.size if four_bit else out_size, x.rg or train is not None)
        if train == "lora":
            r = self.f.lora_rank
            lora_size = 4 if (self.pb < 4 and not self.autocast) else self.pb
            xa = x if self.autocast else self.cast(x, lora_size)
            if self.f.lora_dropout > 0:
                if xa.rg:
                    self.save(self.new(xa.numel, 1 if self.cuda else xa.size, False))
                xa = self.new(xa.numel, xa.size, xa.rg)
            a_in = self.cast(xa, self.cd) if self.autocast else xa
            if self.autocast and xa.size != 4:
                # peft lifts x to the adapter's fp32 first: autocast's bf16 copy is a new tensor
                a_in = self.new(xa.numel, self.cd, xa.rg)
            self.save(a_in)  # grad A = g.T @ x
            a = self.new(rows * r, self.cd if self.autocast else lora_size, True)
            self.save(a)  # grad B = g.T @ A(x)
            if self.autocast:
                self.save_bytes(r * fan_out * self.cd)
                if xa.rg:
                    self.save_bytes(fan_in * r * self.cd)
        return out

    def rmsnorm(self, x: _T, train: str | None) -> _T:
        """Llama RMSNorm: computed in fp32, `weight * (x * rsqrt(mean(x^2) + eps))`."""
        tokens = x.numel // self.f.hidden
        xf = self.cast(x, 4)
        if x.rg:
            self.save(xf, self.new(tokens, 4, True))  # x and rsqrt
        y = self.cast(self.new(x.numel, 4, x.rg), x.size)
        if train:
            self.save(y)
        return self.new(x.numel, max(self.pb, y.size), x.rg or bool(train))

    def layernorm(self, x: _T, train: str | None) -> _T:
        tokens = x.numel // self.f.hidden
        if x.rg or train:
            self.save(x, self.new(tokens, 4, False), self.new(tokens, 4, False))  # x, mean, rstd
        return self.new(x.numel, max(self.pb, x.size), x.rg or bool(train))

    def dropout(self, x: _T, p: float) -> _T:
        if p <= 0:
            return x
        if x.rg:  # CPU keeps the scaled noise tensor, CUDA a boolean mask
            self.save(self.new(x.numel, 1 if self.cuda else x.size, False))
        return self.new(x.numel, x.size, x.rg)

    def pointwise_saving_input(self, x: _T) -> _T:  # silu, gelu
        if x.rg:
            self.save(x)
        return self.new(x.numel, x.size, x.rg)

    def mul(self, a: _T, b: _T) -> _T:
        if a.rg:
            self.save(b)
        if b.rg:
            self.save(a)
        return self.new(max(a.numel, b.numel), max(a.size, b.size), a.rg or b.rg)

    def add(self, a: _T, b: _T) -> _T:
        return self.new(max(a.numel, b.numel), max(a.size, b.size), a.rg or b.rg)

    # attention
    def attention(self, q: _T, k: _T, v: _T, *, dropout: float, rows: int, s: int) -> _T:
        out = self._attention(q, k, v, dropout=dropout, rows=rows, s=s)
        self.attention_mark = self.total
        return out

    def _attention(self, q: _T, k: _T, v: _T, *, dropout: float, rows: int, s: int) -> _T:
        """Scaled dot-product attention over `rows` rows of `s` tokens; returns [tokens, heads*hd].

        Fused kernels (flash / memory-efficient; CPU flash when there is no dropout) keep q, k, v,
        the output and the log-sum-exp. The math fallback (CPU with dropout) keeps the scaled q and
        k, the softmax, the dropout noise and the dropped probabilities: [rows, heads, s, s] each.
        """
        f, c = self.f, self.c
        heads = f.heads
        rg = q.rg or k.rg or v.rg
        # packed rows run SDPA once per example (tunelab.stages.train.attention): no mask, no repeat
        masked = c.masked and not c.packing
        if f.family == "llama" and f.kv_heads != heads and masked:
            # transformers repeats k and v to every head when there is a mask (no enable_gqa)
            k = self.new(k.numel * heads // f.kv_heads, k.size, k.rg)
            v = self.new(v.numel * heads // f.kv_heads, v.size, v.rg)
        if dropout > 0 and not self.cuda:
            # CPU math path, computed in fp32 whatever the input dtype
            qs, ks, vs = (self.new(t.numel, 4, t.rg) for t in (q, k, v))
            if q.rg:
                self.save(ks)
            if k.rg:
                self.save(qs)
            probs = self.new(rows * heads * s * s, 4, rg)
            if rg:
                self.save(probs)
            probs = self.dropout(probs, dropout)
            if probs.rg:
                self.save(vs)
            if v.rg:
                self.save(probs)
            size = self.cd if self.autocast else max(q.size, v.size)
            return self.new(q.numel, size, rg)  # [b, s, h*d]: a copy of the transposed output
        size = self.cd if self.autocast else max(q.size, k.size, v.size)
        q, k, v = self.cast(q, size), self.cast(k, size), self.cast(v, size)
        out = self.new(q.numel, size, rg)
        if rg:
            self.save(q, k, v, out, self.new(rows * heads * s, 4, False))
            if masked:
                # the boolean mask is converted to q's dtype in every layer
                self.save_bytes(rows * s * s * size)
        if c.packing:
            return self.new(q.numel, size, rg)  # the examples' outputs concatenated: a copy
        return out  # [b, s, h, d] layout: the reshape for o_proj is a view

    # blocks
    def block(self, x: _T, train: dict[str, str]) -> _T:
        return self.bert_block(x, train) if self.f.family == "bert" else self.llama_block(x, train)

    def llama_block(self, x: _T, train: dict[str, str]) -> _T:
        f = self.f
        hd, rows, s = f.head_dim, self.rows, self.s
        h = self.rmsnorm(x, train.get("norm1"))
        q = self.linear(h, f.hidden, f.heads * hd, train.get("q"))
        k = self.linear(h, f.hidden, f.kv_heads * hd, train.get("k"))
        v = self.linear(h, f.hidden, f.kv_heads * hd, train.get("v"))
        # RoPE: q * cos + rotate_half(q) * sin with cos/sin in the stream dtype (kept once, shared)
        q = self.new(q.numel, max(q.size, x.size), q.rg)
        k = self.new(k.numel, max(k.size, x.size), k.rg)
        if (q.rg or k.rg) and not self.rope_saved:
            self.rope_saved = True
            self.save_bytes(2 * self.rows_pos * s * hd * x.size)
        a = self.attention(q, k, v, dropout=0.0, rows=rows, s=s)
        o = self.linear(a, f.heads * hd, f.hidden, train.get("o"))
        x = self.add(x, o)
        h = self.rmsnorm(x, train.get("norm2"))
        if f.moe and getattr(self, "layer", -1) in f.moe["sparse_layers"]:
            from tunelab.stages.sizing.moe_walk import moe_mlp

            return self.add(x, moe_mlp(self, h, train))
        g = self.linear(h, f.hidden, f.intermediate, train.get("gate"))
        u = self.linear(h, f.hidden, f.intermediate, train.get("up"))
        m = self.mul(self.pointwise_saving_input(g), u)
        d = self.linear(m, f.intermediate, f.hidden, train.get("down"))
        return self.add(x, d)

    def bert_block(self, x: _T, train: dict[str, str]) -> _T:
        f = self.f
        q = self.linear(x, f.hidden, f.hidden, train.get("q"))
        k = self.linear(x, f.hidden, f.hidden, train.get("k"))
        v = self.linear(x, f.hidden, f.hidden, train.get("v"))
        a = self.attention(q, k, v, dropout=f.attention_dropout, rows=self.rows, s=self.s)
        o = self.dropout(self.linear(a, f.hidden, f.hidden, train.get("o")), f.hidden_dropout)
        y = self.layernorm(self.add(o, x), train.get("norm1"))
        i = self.pointwise_saving_input(self.linear(y, f.hidden, f.intermediate, train.get("up")))
        d = self.linear(i, f.intermediate, f.hidden, train.get("down"))
        d = self.dropout(d, f.hidden_dropout)
        return self.layernorm(self.add(d, y), train.get("norm2"))

    # conv nets: feature maps [batch, channels, height, width]
    def conv2d(self, x: _T, c_out: int, hw: tuple[int, int], train: str | None, fan_in: int) -> _T:
        """A convolution keeps its input whenever anything of it needs a gradient (one
        backward for input and weight), unlike a linear layer. `fan_in`: the inputs one output
        element multiplies (input channels per group x kernel area)."""
        if x.rg or train:
            self.save(self.cast(x, self.cd) if self.autocast else x)
        out = self.new(self.c.micro_batch * c_out * hw[0] * hw[1], self.cd, x.rg or bool(train))
        self.count_flops(2.0 * out.numel * fan_in, x.rg, train)
        self.largest_map = max(self.largest_map, out.nbytes)
        self.block_map = max(self.block_map, out.nbytes)
        return out

    def count_flops(self, forward: float, input_grad: bool, train: str | None) -> None:
        """A conv net's layer: `forward` FLOPs, and as many again in backward for its input's
        gradient (where it needs one) and for its weight's (where it trains)."""
        self.flops[0] += forward
        self.flops[1] += forward * (int(input_grad) + int(train == "weight"))

    def conv_linear(
        self, x: _T, fan_in: int, fan_out: int, train: str | None, *, outside: bool = False
    ) -> _T:
        """A conv net's linear layer (ConvNeXt's pointwise layers, the head), FLOPs counted;
        a LoRA adapter's two small products cost 2 FLOPs a weight forward, twice that back."""
        rows = x.numel // fan_in
        self.count_flops(2.0 * rows * fan_in * fan_out, x.rg, train)
        if train == "lora":
            lora = 2.0 * rows * self.f.lora_rank * (fan_in + fan_out)
            self.flops[0] += lora
            self.flops[1] += 2 * lora
        return self.linear(x, fan_in, fan_out, train, outside=outside)

    def batchnorm(self, x: _T, channels: int, train: str | None) -> _T:
        if x.rg or train:  # the input, the batch mean and inverse std, the running statistics
            self.save(x, self.new(4 * channels, 4, False))
        return self.new(x.numel, x.size, x.rg or bool(train))

    def relu(self, x: _T) -> _T:
        out = self.new(x.numel, x.size, x.rg)
        if x.rg:
            self.save(out)  # relu's backward reads its output
        return out

    def maxpool(self, x: _T, out_numel: int) -> _T:
        if x.rg:
            self.save(x, self.new(out_numel, 8, False))  # the input and the int64 indices
        return self.new(out_numel, x.size, x.rg)

    def _train(self, path: str) -> str | None:
        return (self.f.conv or {}).get("trains", {}).get(path)

    def resnet(self) -> _T:
        """transformers' ResNet: conv 7x7/2 + BN + ReLU, max pool 3x3/2, stages of basic or
        bottleneck layers (conv + BN (+ ReLU)), a 1x1 conv + BN shortcut where the shape
        changes, the residual added in place and a ReLU, then the average pool."""
        cfg, b, tr = self.f.conv or {}, self.c.micro_batch, self._train
        side = -(-int(cfg["image_size"]) // 2)
        x = self.new(b * int(cfg["num_channels"]) * int(cfg["image_size"]) ** 2, self.pb, False)

        def conv_layer(  # noqa: PLR0913
            x: _T, path: str, c_in: int, c_out: int, hw: tuple[int, int], act: bool, k: int = 3
        ) -> _T:
            x = self.conv2d(x, c_out, hw, tr(f"{path}.convolution"), c_in * k * k)
            x = self.batchnorm(x, c_out, tr(f"{path}.normalization"))
            return self.relu(x) if act else x

        c = int(cfg["embedding_size"])
        x = conv_layer(x, "embedder.embedder", int(cfg["num_channels"]), c, (side, side), True, 7)
        side = -(-side // 2)
        x = self.maxpool(x, b * c * side * side)
        bottleneck = cfg.get("layer_type") == "bottleneck"
        first_stride = 2 if cfg.get("downsample_in_first_stage") else 1
        stages = zip(cfg["hidden_sizes"], cfg["depths"], strict=True)
        for i, (c_out, depth) in enumerate(stages):
            for j in range(depth):
                self.group(f"layer.{len(self.blocks)}")
                before, self.block_map = self.total, x.nbytes
                stride = (first_stride if i == 0 else 2) if j == 0 else 1
                out_side = -(-side // stride)
                path, hw = f"encoder.stages.{i}.layers.{j}", (out_side, out_side)
                h = x
                if bottleneck:
                    r = c_out // int(cfg.get("reduction", 4))
                    in_bottleneck = cfg.get("downsample_in_bottleneck")
                    hw1 = hw if in_bottleneck else (side, side)
                    h = conv_layer(h, f"{path}.layer.0", c, r, hw1, True, 1)
                    h = conv_layer(h, f"{path}.layer.1", r, r, hw, True)
                    h = conv_layer(h, f"{path}.layer.2", r, c_out, hw, False, 1)
                else:
                    h = conv_layer(h, f"{path}.layer.0", c, c_out, hw, True)
                    h = conv_layer(h, f"{path}.layer.1", c_out, c_out, hw, False)
                residual = x
                if c != c_out or stride != 1:
                    residual = conv_layer(x, f"{path}.shortcut", c, c_out, hw, False, 1)
                x = self.relu(self.new(h.numel, h.size, h.rg or residual.rg))
                c, side = c_out, out_side
                self.blocks.append((self.total - before, 0))
                self.per_layer.append(self.total - before)
                self.block_maps.append(self.block_map)
        return self.new(b * c, self.pb, x.rg)  # the average pool keeps nothing

    def convnext(self) -> _T:
        """transformers' ConvNeXt: a patchify conv + LayerNorm, stages of a downsampling
        LayerNorm + conv 2x2/2 and blocks (depthwise conv 7x7, LayerNorm, Linear 4x, GELU, Linear,
        layer scale, residual), then the mean over the map and a LayerNorm."""
        cfg, b, tr = self.f.conv or {}, self.c.micro_batch, self._train
        size = int(cfg["image_size"])
        x = self.new(b * int(cfg["num_channels"]) * size * size, self.pb, False)
        patch = int(cfg.get("patch_size", 4))
        side = size // patch
        c = int(cfg["hidden_sizes"][0])
        x = self.conv2d(
            x,
            c,
            (side, side),
            tr("embeddings.patch_embeddings"),
            int(cfg["num_channels"]) * patch**2,
        )
        x = self._norm(x, c, tr("embeddings.layernorm"))
        stages = zip(cfg["hidden_sizes"], cfg["depths"], strict=True)
        for i, (c_out, depth) in enumerate(stages):
            if i > 0:
                x = self._norm(x, c, tr(f"encoder.stages.{i}.downsampling_layer.0"))
                side //= 2
                x = self.conv2d(
                    x, c_out, (side, side), tr(f"encoder.stages.{i}.downsampling_layer.1"), c * 4
                )  # 2x2, stride 2
            c = int(c_out)
            for j in range(depth):
                self.group(f"layer.{len(self.blocks)}")
                before, self.block_map = self.total, x.nbytes
                path = f"encoder.stages.{i}.layers.{j}"
                h = self.conv2d(x, c, (side, side), tr(f"{path}.dwconv"), 49)  # depthwise 7x7
                h = self._norm(h, c, tr(f"{path}.layernorm"))
                h = self.conv_linear(h, c, 4 * c, tr(f"{path}.pwconv1"))
                if h.rg:
                    self.largest_expanded = max(self.largest_expanded, h.nbytes)
                h = self.pointwise_saving_input(h)  # GELU
                h = self.conv_linear(h, 4 * c, c, tr(f"{path}.pwconv2"))
                if cfg.get("layer_scale_init_value", 1e-6) > 0:
                    scale = tr(f"{path}.layer_scale_parameter")
                    if scale:
                        self.save(h)  # grad of the scale = sum(g * h)
                    h = self.new(h.numel, h.size, h.rg or bool(scale))
                x = self.add(x, h)
                self.blocks.append((self.total - before, 0))
                self.per_layer.append(self.total - before)
                self.block_maps.append(self.block_map)
        pooled = self.new(b * c, self.pb, x.rg)  # mean over the map: keeps nothing
        return self._norm(pooled, c, tr("layernorm"), tokens=b)

    def _norm(self, x: _T, channels: int, train: str | None, tokens: int | None = None) -> _T:
        """A LayerNorm over the channels: the input and per position a mean and an rstd."""
        n = tokens if tokens is not None else x.numel // channels
        if x.rg or train:
            self.save(x, self.new(n, 4, False), self.new(n, 4, False))
        return self.new(x.numel, max(self.pb, x.size), x.rg or bool(train))

    def run_conv(self) -> dict[str, int]:
        """A conv net's forward: its feature maps, then the head on the pooled features."""
        f = self.f
        self.per_layer, self.blocks, self.recompute, self.largest_map = [], [], 0, 0
        self.flops = [0.0, 0.0]  # forward, backward (count_flops)
        # each block's largest map, its input's included: the gradients flowing through it
        self.block_maps: list[int] = []
        self.block_map = 0
        self.largest_expanded = 0  # ConvNeXt's 4x map between its two Linear layers
        self.group("embeddings")
        pooled = self.resnet() if f.family == "resnet" else self.convnext()
        self.group("final")
        self.conv_linear(pooled, f.hidden, max(1, f.num_labels), f.head, outside=True)
        return dict(self.groups)

    # the whole model
    def run(self) -> dict[str, int]:
        f, c = self.f, self.c
        if f.family in CONV_FAMILIES:
            return self.run_conv()
        self.rows, self.s = (1, c.tokens) if c.packing else (c.micro_batch, c.seq_len)
        self.rows_pos = 1
        self.rope_saved = False
        tokens = c.tokens
        ids_bytes = tokens * 8
        if f.stages:  # Swin: the patch grid of the first stage, whatever the case's length
            tokens = stage_walk.first_width(f.stages, c.micro_batch) // f.stages[0]["hidden"]
        self.group("embeddings")
        # with checkpointing, transformers makes the embeddings' output require a gradient
        # (enable_input_require_grads) so that frozen layers pass gradients through
        emb_rg = bool(f.embed) or c.checkpointing
        if f.embed:
            self.save_bytes(ids_bytes * (3 if f.family == "bert" else 1))  # index tensors
        x = self.new(tokens * (f.stages[0]["hidden"] if f.stages else f.hidden), self.pb, emb_rg)
        if f.family == "bert":
            x = self.dropout(self.layernorm(x, f.embed), f.hidden_dropout)
        elif c.checkpointing and not f.embed:
            x = self.new(x.numel, x.size, True)
        per_layer: list[int] = []
        # per block: (bytes its backward holds, bytes held up to its attention core)
        self.blocks: list[tuple[int, int]] = []
        self.recompute = 0
        for i in range(f.layers):
            train = f.layer_training[i] if i < len(f.layer_training) else {}
            self.group(f"layer.{i}")
            before = self.total
            self.layer = i
            if f.stages:
                x = stage_walk.enter_layer(self, i, x, f)
            if c.checkpointing:
                # only the block input is kept; the block runs again during backward
                self.save(x)
                sub = _Trace(self.f, c)
                sub.rows, sub.s, sub.rows_pos, sub.rope_saved = self.rows, self.s, 1, True
                sub.layer = i
                out = sub.block(x, train)
                self.recompute = max(self.recompute, sub.total)
                self.blocks.append((sub.total, getattr(sub, "attention_mark", 0)))
                x = self.new(out.numel, out.size, out.rg)
            else:
                self.attention_mark = before
                x = self.block(x, train)
                self.blocks.append((self.total - before, self.attention_mark - before))
            per_layer.append(self.total - before)
        self.f = f
        self.group("final")
        if f.family == "bert":
            pooled_rg = x.rg or bool(f.pooler)
            if f.pooler:
                self.save(x)  # the pooler keeps a view of the last hidden states
            p = self.new(c.micro_batch * f.hidden, self.pb, pooled_rg)
            if pooled_rg:
                self.save(p)  # tanh output
            p = self.dropout(p, f.hidden_dropout)
            self.linear(p, f.hidden, max(1, f.num_labels), f.head, outside=True)
        else:
            # tunelab.stages.train.losses: hidden states gathered at the loss positions before the head
            h = self.rmsnorm(x, f.final_norm)
            n = loss_token_count(c)
            if h.rg:
                self.save_bytes(n * 8)  # the gather's index
            gathered = self.new(n * f.hidden, h.size, h.rg)
            head = f.head or (f.embed if f.tied_embeddings else None)
            if self.loss_route != "fused":  # the fused loss keeps gradients, not its inputs
                self.linear(gathered, f.hidden, f.vocab, head, outside=True)
        self.per_layer = per_layer
        return dict(self.groups)


# ------------------------------------------------------------------ the estimate


# tunelab.stages.train.losses: logits computed at once by a head that is not fused, and by the fused
# loss (in chunks of at least FUSED_MIN_ROWS rows)
CHUNK_LOGITS = 1 << 26
FUSED_CHUNK_LOGITS = 1 << 22
FUSED_MIN_ROWS = 256


def loss_token_count(case: Case) -> int:
    """Positions carrying loss in a micro-batch (the shift drops one position per example)."""
    shifted = case.micro_batch * (case.seq_len - 1)
    return max(1, round(shifted * min(1.0, max(0.0, case.loss_fraction))))


def loss_route(facts: ModelFacts, strategy: str = "single") -> str:
    """How tunelab.stages.train.losses computes the cross-entropy: "fused" (a plain head, one
    process), "chunked" (a LoRA head) or "model" (DDP / FSDP: the head inside the forward)."""
    if facts.architecture != "causal_lm":
        return "model"
    if strategy != "single":
        return "model"
    return "chunked" if facts.head == "lora" else "fused"


def logits_bytes(facts: ModelFacts, case: Case, route: str = "fused") -> dict[str, int]:
    """The cross-entropy buffers of tunelab's loss (tunelab.stages.train.losses) on `route`.

    `kept` is what the loss keeps from forward to backward; `forward` and `backward` what is
    alive at its largest moment in each. causal LM, the head on the loss positions only:
    - fused: per chunk of rows, the logits in fp32 (turned into the softmax in place; beside
      their compute-dtype copy under autocast), the head's weight in the compute dtype under
      autocast, and the
      gradients it makes at once: of the hidden states [n, hidden] and of a trained head
      [vocab, hidden] (summed in fp32, kept in the weight's dtype); backward scales them;
    - chunked: [n, vocab] logits in the compute dtype, lifted to fp32, log_softmax keeping its
      fp32 output for backward; above CHUNK_LOGITS logits the rows go in chunks recomputed in
      backward, so one chunk is alive at a time;
    - model: the same all at once (the head runs inside the model's forward).
    """
    if facts.architecture != "causal_lm":
        n = case.micro_batch * max(1, facts.num_labels) * 4
        return {
            "logits": n,
            "loss_tokens": case.micro_batch,
            "forward": 3 * n,
            "backward": 3 * n,
            "kept": n,
        }
    pb = DTYPE_BYTES.get(facts.param_dtype, 4)
    cd = 2 if case.precision in ("bf16", "fp16") else pb
    v = facts.vocab
    n = loss_token_count(case)
    if route == "fused":
        rows = min(n, max(FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS // v))
        trains = facts.head == "weight" or (facts.tied_embeddings and facts.embed == "weight")
        grad_h = n * facts.hidden * pb
        # the head's gradient is summed in fp32 over the chunks, then kept in the weight's dtype
        grad_w_sum = v * facts.hidden * 4 if trains else 0
        grad_w = v * facts.hidden * pb if trains else 0
        weight_copy = v * facts.hidden * cd if cd != pb else 0
        chunk = weight_copy + rows * v * (4 + (cd if cd != 4 else 0)) + grad_h + grad_w_sum
        return {
            "logits": rows * v * cd,
            "loss_tokens": n,
            "chunk_rows": rows,
            "kept": grad_h + grad_w,
            "forward": max(chunk, grad_h + grad_w_sum + (grad_w if pb != 4 else 0)),
            "backward": grad_h + grad_w + grad_h,
        }
    chunked = route == "chunked" and n * v > CHUNK_LOGITS
    rows = max(1, CHUNK_LOGITS // v) if chunked else n
    logits = rows * v * cd
    lifted = rows * v * 4 if cd != 4 else 0
    log_probs = rows * v * 4
    return {
        "logits": logits,
        "loss_tokens": n,
        "chunk_rows": rows,
        "kept": 0 if chunked else log_probs,
        "forward": logits + lifted + log_probs,
        "backward": 3 * rows * v * 4 + (logits if chunked else 0),
    }


def conv_flops(facts: ModelFacts, examples: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of a conv net's micro-batch of `examples` images of
    `facts.conv["image_size"]`: its convolutions and linear layers, as the walk meets them
    (normalization, activations and pooling, a few % of a ResNet's, are left out)."""
    side = int((facts.conv or {})["image_size"])
    trace = _Trace(facts, Case(seq_len=side, micro_batch=max(1, int(examples))))
    trace.run_conv()
    return trace.flops[0], trace.flops[1]


def _conv_temporaries(trace: _Trace) -> tuple[int, int]:
    """A conv net's backward: the gradient of its largest feature map, or the two of a
    ConvNeXt GELU (into and out of it) over the 4x map."""
    return max(trace.largest_map, 2 * trace.largest_expanded), 0


def _block_backward_temporaries(facts: ModelFacts, case: Case) -> tuple[int, int]:
    """Working memory while one block runs backward, (MLP part, attention part).

    The MLP runs backward first, with the whole block's saved tensors still held, making one
    [tokens, intermediate] gradient at a time; the attention runs when the MLP's saved tensors
    are gone, with the gradients of q, k, v (fused kernels) or of the [rows, heads, s, s] scores
    (the CPU math path with dropout).
    """
    cd = 2 if case.precision in ("bf16", "fp16") else DTYPE_BYTES.get(facts.param_dtype, 4)
    tokens = case.tokens
    rows, s = (1, tokens) if case.packing else (case.micro_batch, case.seq_len)
    # the gated MLP's backward holds the gradients of gate and up beside each other
    mlp = (
        (2 if facts.family == "llama" else 1) * tokens * max(facts.intermediate, facts.hidden) * cd
    )
    attention = 3 * tokens * facts.heads * facts.head_dim * cd
    if facts.family == "bert" and facts.attention_dropout > 0 and case.device != "cuda":
        attention = 2 * rows * facts.heads * s * s * 4
    return mlp, attention


def quant_constants_of(shapes: list[int], double_quant: bool) -> int:
    """Bytes of bitsandbytes' 4-bit quantization constants for tensors of `shapes` weights."""
    total = 0
    for numel in shapes:
        blocks = -(-numel // QUANT_BLOCK)
        total += 16 * 4  # the 4-bit code (nf4 / fp4 values)
        if double_quant:
            total += blocks + 4 * -(-blocks // QUANT_BLOCK2) + 256 * 4 + 4
        else:
            total += 4 * blocks
    return total


def dequantized_layer_bytes(facts: ModelFacts) -> int:
    """The largest 4-bit layer dequantized for a matmul: in the dtype it was quantized from,
    and cast to the compute dtype when that differs (bitsandbytes' backward does both)."""
    if not facts.quant_params:
        return 0
    src = DTYPE_BYTES.get(facts.quant_dtype, 4)
    compute = DTYPE_BYTES.get(facts.quant_compute_dtype, 2)
    return facts.quant_largest * (
        src + (compute if facts.quant_compute_dtype != facts.quant_dtype else 0)
    )


def optimizer_state_bytes(facts: ModelFacts, optimizer: str) -> tuple[int, bool]:
    """(bytes, known): optimizer states in the parameters' dtype (AdamW: exp_avg, exp_avg_sq)."""
    if optimizer in EIGHT_BIT_STATES:
        n = facts.trainable_params
        absmax = 4 * -(-n // EIGHT_BIT_BLOCK)
        return EIGHT_BIT_STATES[optimizer] * (n + absmax), True
    known = optimizer in OPTIMIZER_STATES
    per_param = OPTIMIZER_STATES.get(optimizer, 2)
    return per_param * facts.trainable_bytes, known


def rule_x4(facts: ModelFacts) -> int:
    """The common rule of thumb (accelerate estimate-memory): weights x 4 for Adam training."""
    return 4 * facts.total_weight_bytes


def cuda_workspace_bytes(major: int) -> int:
    """cuBLAS workspaces, allocated through PyTorch's caching allocator: one per thread that
    runs matmuls (the forward's and the autograd engine's), 32 MiB each from Hopper on, else
    4 MiB x 2 + 16 KiB x 8 (PyTorch's defaults without CUBLAS_WORKSPACE_CONFIG)."""
    each = 32 * 2**20 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return 2 * each


def _embedding_bytes(facts: ModelFacts) -> int:
    """Weights outside the blocks: embeddings, and an untied output layer."""
    pb = DTYPE_BYTES.get(facts.param_dtype, 4)
    untied_head = facts.architecture == "causal_lm" and not facts.tied_embeddings
    return facts.vocab * facts.hidden * pb * (2 if untied_head else 1)


def _batch_bytes(facts: ModelFacts, case: Case) -> int:
    """The micro-batch itself: ids, mask and labels (int64), or a conv net's fp32 pixels."""
    if facts.family in CONV_FAMILIES and facts.conv:
        side = int(facts.conv["image_size"])
        return case.micro_batch * (int(facts.conv["num_channels"]) * side * side * 4 + 8)
    return case.tokens * 8 * 3


def estimate_memory(
    facts: ModelFacts, case: Case, *, strategy: str = "single", ranks: int = 1
) -> Estimate:
    """Predict the memory of one optimizer step of `case` for the model and adaptation `facts`.

    `strategy` "ddp": one full replica per rank plus DDP's gradient buckets (a flat copy of the
    gradients); "fsdp": weights, gradients and optimizer states sharded over `ranks`, plus the
    block being computed gathered whole (twice with prefetch, or the root's embeddings) and its
    unsharded gradient before the reduce-scatter. Per rank, with `case.micro_batch` per rank.
    """
    if facts.family not in FAMILIES:
        raise ValueError(f"unknown block family {facts.family!r}")
    if strategy not in ("single", "ddp", "fsdp"):
        raise ValueError(f"unknown strategy {strategy!r}")
    ranks = max(1, int(ranks))
    shard = ranks if strategy == "fsdp" else 1
    notes: list[str] = []
    route = loss_route(facts, strategy)
    trace = _Trace(facts, case, route)
    detail = trace.run()
    activations = trace.total
    recompute = trace.recompute
    per_layer = trace.per_layer
    pb = DTYPE_BYTES.get(facts.param_dtype, 4)
    weights = facts.total_weight_bytes // shard
    grads = facts.trainable_bytes // shard
    opt_full, known = optimizer_state_bytes(facts, case.optimizer)
    opt = opt_full // shard
    if not known:
        notes.append(f"optimizer {case.optimizer}: states assumed 2 per parameter")
    n = max(1, facts.layers)
    block = max(0, facts.total_weight_bytes - _embedding_bytes(facts)) // n
    gathered = max(_embedding_bytes(facts), 2 * block) if shard > 1 else 0
    gathered_grad = facts.trainable_bytes // n if shard > 1 else 0
    buckets = facts.trainable_bytes if strategy == "ddp" and ranks > 1 else 0
    loss = logits_bytes(facts, case, route)
    conv = facts.family in CONV_FAMILIES
    temps = _conv_temporaries(trace) if conv else _block_backward_temporaries(facts, case)
    # the optimizer step: foreach kernels (CUDA) make a temporary per trainable tensor at once;
    # the CPU loop one tensor at a time
    opt_temps = grads if case.device == "cuda" else 2 * facts.largest_trainable_bytes
    dequantized = dequantized_layer_bytes(facts)  # during each 4-bit matmul, forward and backward
    batch = _batch_bytes(facts, case)
    runtime = cuda_workspace_bytes(case.cuda_major) if case.device == "cuda" else 0
    # With accumulation, the gradients of earlier micro-steps are alive in later forwards.
    held = grads if case.grad_accum > 1 else 0
    # When gradients appear: the output layer's at the start of backward (with tied embeddings
    # that is the embedding's: vocab x hidden), the blocks' one block at a time, the input
    # embedding's (untied) at the very end.
    vocab_bytes = facts.vocab * facts.hidden * pb
    if facts.architecture == "causal_lm":
        first = vocab_bytes if (facts.head == "weight" or facts.embed == "weight") else 0
        last = vocab_bytes if facts.embed == "weight" and not facts.tied_embeddings else 0
    else:
        pooler = facts.hidden * facts.hidden * pb if facts.pooler == "weight" else 0
        first = max(1, facts.num_labels) * facts.hidden * pb + pooler if facts.head else 0
        last = vocab_bytes if facts.embed == "weight" else 0
    first, last = first // shard, last // shard
    block_grads = max(0, grads - first - last)
    phases = {
        "forward_end": activations + max(loss["forward"], dequantized) + held + gathered,
        "loss_backward": activations + loss["backward"] + max(held, first) + gathered,
    }
    # layer backward: block i runs with the activations of blocks < i still kept and the
    # gradients of the blocks above already made; inside it, the MLP runs backward first with
    # the block's saved tensors held, the attention later without the MLP's
    mlp_temp, attention_temp = temps
    flowing = 2 * case.tokens * facts.hidden * pb
    kept_below = detail.get("embeddings", 0)
    best = 0
    for i in range(n - 1, -1, -1):
        below = sum(per_layer[:i])
        saved, upto_attention = trace.blocks[i] if i < len(trace.blocks) else (0, 0)
        own_input = per_layer[i] if case.checkpointing and i < len(per_layer) else 0
        # + the gradient arriving at the block's output and the one leaving its input
        if conv:
            flowing = 2 * trace.block_maps[i] if i < len(trace.block_maps) else 0
        inner = max(saved + mlp_temp, upto_attention + attention_temp) + flowing + dequantized
        grads_done = first + block_grads * (n - 1 - i) / n
        live = kept_below + below + own_input + inner + max(held, grads_done)
        best = max(best, live + gathered + gathered_grad)
    phases["layer_backward"] = int(best)
    phases["optimizer_step"] = grads + opt_temps
    peak_phase = max(phases, key=lambda k: phases[k])
    transient = phases[peak_phase]
    approximate = facts.approximate
    if conv and (case.checkpointing or case.precision != "fp32"):
        approximate = True  # the walk follows a conv net's fp32 forward without recomputation
        notes.append("conv net: mixed precision and checkpointing are not walked")
    elif facts.approximate:
        notes.append("activations estimated with the Llama-like block: the measurement decides")
    return Estimate(
        weights=weights,
        weights_by_dtype={
            **{k: v // shard for k, v in facts.weight_bytes.items()},
            **(
                {"4bit_constants": facts.quant_constant_bytes // shard}
                if facts.quant_params
                else {}
            ),
        },
        gradients=grads,
        optimizer_states=opt,
        activations=activations,
        activations_detail={**detail, "recompute_one_block": recompute},
        logits_loss=max(loss["forward"], loss["backward"]),
        backward_temporaries=max(temps),
        optimizer_temporaries=opt_temps,
        peak_phase=peak_phase,
        phases=phases,
        peak_total=weights + batch + runtime + opt + buckets + transient,
        peak_increase=runtime + opt + buckets + transient,
        rule_x4=rule_x4(facts),
        approximate=approximate,
        notes=notes,
        dequantized_layer=dequantized,
    )


def project_per_rank(facts: ModelFacts, case: Case, ranks: int) -> dict[str, int]:
    """Per-rank peak bytes over `ranks` ranks, each with `case.micro_batch`: DDP and FSDP."""
    return {
        "ranks": ranks,
        "ddp": estimate_memory(facts, case, strategy="ddp", ranks=ranks).peak_total,
        "fsdp": estimate_memory(facts, case, strategy="fsdp", ranks=ranks).peak_total,
    }
