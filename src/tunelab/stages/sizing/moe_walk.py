"""The forward walk of a mixture-of-experts MLP block, for the memory model (`sizing.memory`).

transformers 5.24 runs a sparse block as: a router linear over every token, a softmax in fp32,
the top-k experts per token (their weights renormalized where the family does), then per expert
hit the rows routed to it gathered (`hidden[token_idx]`), one fused gate-up matmul, SiLU of the
gate times up, the down matmul, a multiplication by the routing weight and an `index_add_` back.
Summed over the experts, the routed rows are `tokens x top_k`: what autograd keeps grows with
top-k, not with the number of experts (which only the weights, gradients and optimizer states
see, every expert resident). Shared experts are a dense gated MLP beside them. With
`output_router_logits` the router logits of every layer stay alive for the auxiliary
load-balancing loss.

`moe_mlp(trace, h, train) -> _T`: the block's MLP output; `train` maps "experts", "router" and
"shared" to "weight" | "lora" | absent.
"""

from __future__ import annotations

from typing import Any


def moe_mlp(t: Any, h: Any, train: dict[str, str]) -> Any:
    """Record what the sparse MLP of one block keeps for backward; returns its output."""
    f, moe = t.f, t.f.moe
    tokens = h.numel // f.hidden
    experts, k, width = int(moe["experts"]), int(moe["top_k"]), int(moe["expert_intermediate"])
    logits = t.linear(h, f.hidden, experts, train.get("router"))  # [tokens, experts]
    if moe.get("router_logits_kept"):
        t.save(logits)  # the auxiliary loss reads every layer's logits after the forward
    probs = t.new(tokens * experts, 4, logits.rg)
    if logits.rg:
        t.save(probs)  # softmax keeps its output
        t.save_bytes(tokens * k * 8)  # top-k's indices
    weights = t.new(tokens * k, 4, logits.rg)
    if weights.rg:
        t.save(weights)  # renormalization keeps the top-k values and their sum
    # the rows routed to the experts, tokens x top_k of them, gathered copies of h
    routed = t.new(tokens * k * f.hidden, h.size, h.rg)
    if h.rg:
        t.save_bytes(tokens * k * 8)  # the gather's token indices
    gate_up = t.linear(routed, f.hidden, 2 * width, train.get("experts"))
    if gate_up.rg:
        t.save(gate_up)  # SiLU keeps the gate and the product keeps up: both views of it
    act = t.new(tokens * k * width, gate_up.size, gate_up.rg)
    if gate_up.rg:
        t.save(act)
    product = t.new(tokens * k * width, gate_up.size, gate_up.rg)
    down = t.linear(product, width, f.hidden, train.get("experts"))
    t.mul(down, weights)  # the routing weight: keeps both (each needs the other's gradient)
    out = t.new(tokens * f.hidden, max(h.size, down.size), down.rg or weights.rg)
    shared = int(moe.get("shared_intermediate") or 0)
    if shared:
        g = t.linear(h, f.hidden, shared, train.get("shared"))
        u = t.linear(h, f.hidden, shared, train.get("shared"))
        m = t.mul(t.pointwise_saving_input(g), u)
        out = t.add(out, t.linear(m, shared, f.hidden, train.get("shared")))
    return out
