"""The analytic memory model of one training step: pure arithmetic over the architecture.

`estimate_memory(facts, case)` predicts, for one model, adaptation and step configuration:

- weights by dtype, gradients of the trainable parameters, optimizer states;
- activations: what autograd keeps for backward at the end of the forward pass. They are
  counted by walking the forward pass of one transformer block op by op (`walk.Trace`) with the
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

Where each part lives: the terms (`ModelFacts`, `Case`, `Estimate`, byte tables) in
`sizing.terms`, the forward walk in `sizing.walk`, the loss term in `sizing.loss_memory`; this
module sums them into the phases and the peak.

Interface: `ModelFacts`, `Case(seq_len, micro_batch, grad_accum, precision, checkpointing, packing,
masked, loss_fraction, optimizer, device)`, `estimate_memory(facts, case, strategy="single" | "ddp"
| "fsdp", ranks=1) -> Estimate` (bytes: `weights`, `gradients`, `optimizer_states`, `activations`,
`logits_loss`, `phases`, `peak_total`, `peak_increase`, `rule_x4`, `dequantized_layer`),
`project_per_rank(facts, case, n)`. `loss_memory.loss_route(facts, strategy) -> "fused" | "chunked" | "model"`
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

from tunelab.stages.sizing.loss_memory import logits_bytes, loss_route
from tunelab.stages.sizing.terms import (
    CONV_FAMILIES,
    DTYPE_BYTES,
    EIGHT_BIT_BLOCK,
    EIGHT_BIT_STATES,
    FAMILIES,
    OPTIMIZER_STATES,
    QUANT_BLOCK,
    QUANT_BLOCK2,
    Case,
    Estimate,
    ModelFacts,
)
from tunelab.stages.sizing.walk import Trace


def _conv_temporaries(trace: Trace) -> tuple[int, int]:
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
    trace = Trace(facts, case, route)
    detail = trace.run()
    weights = facts.total_weight_bytes // shard
    grads = facts.trainable_bytes // shard
    opt_full, known = optimizer_state_bytes(facts, case.optimizer)
    opt = opt_full // shard
    if not known:
        notes.append(f"optimizer {case.optimizer}: states assumed 2 per parameter")
    buckets = facts.trainable_bytes if strategy == "ddp" and ranks > 1 else 0
    loss = logits_bytes(facts, case, route)
    conv = facts.family in CONV_FAMILIES
    temps = _conv_temporaries(trace) if conv else _block_backward_temporaries(facts, case)
    # the optimizer step: foreach kernels (CUDA) make a temporary per trainable tensor at once;
    # the CPU loop one tensor at a time
    opt_temps = grads if case.device == "cuda" else 2 * facts.largest_trainable_bytes
    phases = _phases(facts, case, trace, detail, loss, temps, shard)
    phases["optimizer_step"] = grads + opt_temps
    peak_phase = max(phases, key=lambda k: phases[k])
    transient = phases[peak_phase]
    batch = _batch_bytes(facts, case)
    runtime = cuda_workspace_bytes(case.cuda_major) if case.device == "cuda" else 0
    return Estimate(
        weights=weights,
        weights_by_dtype=_weights_by_dtype(facts, shard),
        gradients=grads,
        optimizer_states=opt,
        activations=trace.total,
        activations_detail={**detail, "recompute_one_block": trace.recompute},
        logits_loss=max(loss["forward"], loss["backward"]),
        backward_temporaries=max(temps),
        optimizer_temporaries=opt_temps,
        peak_phase=peak_phase,
        phases=phases,
        peak_total=weights + batch + runtime + opt + buckets + transient,
        peak_increase=runtime + opt + buckets + transient,
        rule_x4=rule_x4(facts),
        approximate=_approximate(facts, case, notes),
        notes=notes,
        dequantized_layer=dequantized_layer_bytes(facts),
    )


def _weights_by_dtype(facts: ModelFacts, shard: int) -> dict[str, int]:
    """Weight bytes per dtype on one rank, a 4-bit base's constants apart."""
    out = {k: v // shard for k, v in facts.weight_bytes.items()}
    if facts.quant_params:
        out["4bit_constants"] = facts.quant_constant_bytes // shard
    return out


def _approximate(facts: ModelFacts, case: Case, notes: list[str]) -> bool:
    """Whether the estimate is approximate, with the note saying why added to `notes`."""
    if facts.family in CONV_FAMILIES and (case.checkpointing or case.precision != "fp32"):
        # the walk follows a conv net's fp32 forward without recomputation
        notes.append("conv net: mixed precision and checkpointing are not walked")
        return True
    if facts.approximate:
        notes.append("activations estimated with the Llama-like block: the measurement decides")
    return facts.approximate


def _gradient_ends(facts: ModelFacts, shard: int) -> tuple[int, int]:
    """(first, last): the gradient bytes made at the start of backward and at its very end.

    The output layer's comes first (with tied embeddings that is the embedding's: vocab x
    hidden), the blocks' one block at a time, the input embedding's (untied) at the very end.
    """
    pb = DTYPE_BYTES.get(facts.param_dtype, 4)
    vocab_bytes = facts.vocab * facts.hidden * pb
    if facts.architecture == "causal_lm":
        first = vocab_bytes if (facts.head == "weight" or facts.embed == "weight") else 0
        last = vocab_bytes if facts.embed == "weight" and not facts.tied_embeddings else 0
    else:
        pooler = facts.hidden * facts.hidden * pb if facts.pooler == "weight" else 0
        first = max(1, facts.num_labels) * facts.hidden * pb + pooler if facts.head else 0
        last = vocab_bytes if facts.embed == "weight" else 0
    return first // shard, last // shard


def _phases(
    facts: ModelFacts,
    case: Case,
    trace: Trace,
    detail: dict[str, int],
    loss: dict[str, int],
    temps: tuple[int, int],
    shard: int,
) -> dict[str, int]:
    """What is alive at the end of the forward, in the loss's backward and at the worst moment
    of the layers' backward (the optimizer step is the caller's)."""
    grads = facts.trainable_bytes // shard
    n = max(1, facts.layers)
    block = max(0, facts.total_weight_bytes - _embedding_bytes(facts)) // n
    gathered = max(_embedding_bytes(facts), 2 * block) if shard > 1 else 0
    gathered_grad = facts.trainable_bytes // n if shard > 1 else 0
    dequantized = dequantized_layer_bytes(facts)  # during each 4-bit matmul, forward and backward
    # With accumulation, the gradients of earlier micro-steps are alive in later forwards.
    held = grads if case.grad_accum > 1 else 0
    first, last = _gradient_ends(facts, shard)
    activations = trace.total
    phases = {
        "forward_end": activations + max(loss["forward"], dequantized) + held + gathered,
        "loss_backward": activations + loss["backward"] + max(held, first) + gathered,
    }
    # layer backward: block i runs with the activations of blocks < i still kept and the
    # gradients of the blocks above already made; inside it, the MLP runs backward first with
    # the block's saved tensors held, the attention later without the MLP's
    pb = DTYPE_BYTES.get(facts.param_dtype, 4)
    mlp_temp, attention_temp = temps
    conv = facts.family in CONV_FAMILIES
    block_grads = max(0, grads - first - last)
    flowing = 2 * case.tokens * facts.hidden * pb
    kept_below = detail.get("embeddings", 0)
    per_layer = trace.per_layer
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
    return phases


def project_per_rank(facts: ModelFacts, case: Case, ranks: int) -> dict[str, int]:
    """Per-rank peak bytes over `ranks` ranks, each with `case.micro_batch`: DDP and FSDP."""
    return {
        "ranks": ranks,
        "ddp": estimate_memory(facts, case, strategy="ddp", ranks=ranks).peak_total,
        "fsdp": estimate_memory(facts, case, strategy="fsdp", ranks=ranks).peak_total,
    }
