"""The loss term of the memory model: the logits and cross-entropy buffers of tunelab's loss
(`tunelab.stages.train.losses`), by the route the loss takes (`loss_route`): "fused" (a plain
head in one process), "chunked" (a LoRA head) or "model" (DDP / FSDP: the head inside the
model's forward).
"""

from __future__ import annotations

from tunelab.stages.sizing.terms import DTYPE_BYTES, Case, ModelFacts

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
