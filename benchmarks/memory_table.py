"""The analytic memory of one training step of a 7-8B model: full, LoRA and QLoRA side by side.

    python benchmarks/memory_table.py                              # Llama-3-8B, 2048 tokens
    python benchmarks/memory_table.py --seq-len 4096 --micro-batch 2 --rank 64

From the published Llama-3-8B config alone (no weights: `tunelab.stages.plan.shapes.facts_from_config`)
through tunelab's own memory model (`tunelab.stages.sizing.memory.estimate_memory`) on one CUDA GPU:
bf16 weights and autocast, LoRA on every linear layer of every block, one micro-batch of packed
examples with activation checkpointing on and off. The QLoRA columns hold the block weights in
NF4 with double quantization (their constants counted), the adapter in fp32, and the
dequantized copy of the largest layer; the optimizer is AdamW (torch, states in the trained
parameters' dtype) or bitsandbytes' 8-bit AdamW. It prints a Markdown table in GiB and, as a
peer, the weights x 4 rule of thumb (`accelerate estimate-memory`'s training figure) per column.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from tunelab.core.config_training import AdaptationConfig
from tunelab.stages.plan.shapes import facts_from_config
from tunelab.stages.sizing.memory import Case, estimate_memory

LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B config.json
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
GIB = 2**30


def columns(rank: int) -> list[tuple[str, AdaptationConfig, str]]:
    lora = {"target_modules": "all-linear", "rank": rank, "alpha": 2 * rank, "dropout": 0.0}
    return [
        ("full", AdaptationConfig(method="full"), "AdamW"),
        (f"LoRA r{rank}", AdaptationConfig(method="lora", **lora), "AdamW"),
        (f"QLoRA r{rank}", AdaptationConfig(method="qlora", **lora), "AdamW"),
        (f"QLoRA r{rank} 8-bit", AdaptationConfig(method="qlora", **lora), "PagedAdamW8bit"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    rows: dict[str, list[str]] = {}
    order = [
        "weights (4-bit constants)",
        "trainable parameters",
        "gradients",
        "optimizer states",
        "activations, ckpt off",
        "activations, ckpt on",
        "dequantized layer",
        "peak, ckpt off",
        "peak, ckpt on",
        "weights x 4 rule",
    ]
    names = []
    for name, adaptation, optimizer in columns(args.rank):
        names.append(name)
        facts = facts_from_config(LLAMA3_8B, adaptation, architecture="causal_lm", dtype="bfloat16")
        case = Case(
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            precision="bf16",
            packing=True,
            optimizer=optimizer,
            device="cuda",
        )
        off = estimate_memory(facts, case)
        on = estimate_memory(facts, replace(case, checkpointing=True))
        constants = off.weights_by_dtype.get("4bit_constants", 0)
        cells = {
            "weights (4-bit constants)": f"{off.weights / GIB:.2f}"
            + (f" ({constants / GIB:.2f})" if constants else ""),
            "trainable parameters": f"{facts.trainable_params / 1e6:,.0f} M",
            "gradients": f"{off.gradients / GIB:.2f}",
            "optimizer states": f"{off.optimizer_states / GIB:.2f}",
            "activations, ckpt off": f"{off.activations / GIB:.2f}",
            "activations, ckpt on": f"{on.activations / GIB:.2f}",
            "dequantized layer": f"{off.dequantized_layer / GIB:.2f}",
            "peak, ckpt off": f"{off.peak_total / GIB:.2f}",
            "peak, ckpt on": f"{on.peak_total / GIB:.2f}",
            "weights x 4 rule": f"{off.rule_x4 / GIB:.2f}",
        }
        for key in order:
            rows.setdefault(key, []).append(cells[key])
    print(
        f"Llama-3-8B shape, {args.seq_len} tokens x micro-batch {args.micro_batch}, bf16, "
        f"one CUDA GPU (GiB; trainable parameters in millions)\n"
    )
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key in order:
        print(f"| {key} | " + " | ".join(rows[key]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
