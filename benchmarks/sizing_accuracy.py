"""How close the analytic memory model comes to measured training steps, beside the weights x 4 rule.

For each model: full fine-tuning and LoRA, activation checkpointing off and on, three sequence
lengths. Every row is one real optimizer step (after a warm-up step) of tunelab's training loop
in its own process (`tunelab.stages.sizing.measure`), compared with `tunelab.stages.sizing.memory`'s estimate:

- CPU: the RSS a step adds to the idle process (model, optimizer and batch loaded) against the
  predicted increase (optimizer states, gradients, activations, logits, temporaries). The rule's
  prediction of that increase is weights x 4 - weights (the weights are already in the idle RSS).
- CUDA: `max_memory_allocated` against the predicted peak total; the rule: weights x 4.

Target: within 15 % on CPU for every row, within 10 % of max allocated on a GPU.

    python benchmarks/sizing_accuracy.py                      # tiny Llama + MiniLM
    python benchmarks/sizing_accuracy.py --models tiny-moe    # a tiny Qwen3-MoE (8 experts, top 2)
    python benchmarks/sizing_accuracy.py --models tiny,minilm,smollm2   # + SmolLM2-135M (slow)
    # on a GPU, without any asset: SmolLM2-135M's and Llama-3.2-1B's shapes, random weights
    python benchmarks/sizing_accuracy.py --models smollm2-shape,llama1b-shape \
        --device cuda --precision bf16 --lengths 512,2048 --micro-batch 8 --json-out rows.json

The last line reads `max_error_pct=E rule_x4_max_error_pct=F`. Each row also gives the measured
step time and tokens per second (the throughput of tunelab's training loop on that shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tunelab.stages.sizing.memory import Case, ModelFacts
from tunelab.stages.sizing.processes import measure_in_subprocess
from tunelab.stages.sizing.record import compare_row

MODELS = {
    # name: (architecture, LoRA targets, lengths, micro-batch)
    "tiny": ("causal_lm", ["q_proj", "v_proj"], [64, 128, 256], 8),
    "tiny-moe": ("causal_lm", ["q_proj", "v_proj"], [64, 128, 256], 8),
    "minilm": ("encoder", ["query", "value"], [64, 128, 256], 8),
    "smollm2": ("causal_lm", ["q_proj", "v_proj"], [128, 256, 512], 2),
    "smollm2-shape": ("causal_lm", ["q_proj", "v_proj"], [512, 1024, 2048], 8),
    "llama1b-shape": ("causal_lm", ["q_proj", "v_proj"], [1024, 2048], 4),
}

# Published shapes, built with random weights (memory and speed depend on the shape alone):
# SmolLM2-135M-Instruct and Llama-3.2-1B.
SHAPES = {
    "smollm2-shape": dict(
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
    ),
    "llama1b-shape": dict(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131_072,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
    ),
}


def save_shape(name: str, folder: Path) -> None:
    """A Llama of a published shape with random weights and the tiny ChatML tokenizer (the
    measured steps use synthetic token ids: the tokenizer only makes the folder loadable)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunelab.lib.models.tiny import build_tiny_causal_tokenizer

    torch.manual_seed(0)
    tok = build_tiny_causal_tokenizer()
    cfg = LlamaConfig(
        **SHAPES[name],
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def model_section(name: str, workdir: Path) -> dict:
    if name == "tiny":
        from tunelab.lib.models.tiny import save_tiny_llama

        folder = workdir / "tiny-llama-h256"
        if not folder.exists():
            # the tunelab.lib.models.tiny Llama, wider (hidden 256, 4 layers) so that a step's tensors
            # outweigh the runtime's own few MB
            save_tiny_llama(folder, hidden=256, layers=4, heads=4)
        return {"path": str(folder), "architecture": "causal_lm"}
    if name == "tiny-moe":
        from tunelab.lib.models.tiny import save_tiny_moe

        folder = workdir / "tiny-qwen3-moe-h256"
        if not folder.exists():
            # a Qwen3-MoE as wide as the tiny Llama above: 8 experts of 256, 2 routed a token
            save_tiny_moe(folder, hidden=256, layers=4, heads=4, expert_intermediate=256)
        return {"path": str(folder), "architecture": "causal_lm"}
    if name == "minilm":
        from tunelab.core.assets import minilm_path

        return {"path": str(minilm_path()), "architecture": "encoder"}
    if name in SHAPES:
        folder = workdir / name
        if not (folder / "config.json").exists():
            save_shape(name, folder)
        return {"path": str(folder), "architecture": "causal_lm"}
    if name == "smollm2":
        from tunelab.core.assets import smollm2_gguf

        folder, gguf = smollm2_gguf()
        return {"path": str(folder), "gguf_file": gguf, "architecture": "causal_lm"}
    raise SystemExit(f"unknown model {name!r}; choose among {', '.join(MODELS)}")


def config(
    model: dict, method: str, targets: list[str], encoder: bool, threads: int, precision: str
) -> dict:
    return {
        "name": "sizing-accuracy",
        "hypothesis": {
            "behaviour": "b",
            "rationale": "r",
            "expected_effect": "e",
            "primary_metric": "accuracy",
        },
        "guardrails": [],
        "data": {"source": {"format": "jsonl", "path": "unused.jsonl"}},
        "model": model,
        "adaptation": {
            "method": method,
            "target_modules": targets,
            "rank": 8,
            "alpha": 16,
            "modules_to_save": ["classifier"] if encoder and method == "lora" else [],
        },
        "training": {"num_threads": threads, "packing": True, "precision": precision},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,minilm", help=", ".join(MODELS))
    ap.add_argument("--methods", default="full,lora")
    ap.add_argument("--lengths", default=None, help="override the lengths, e.g. 64,128")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--allocator", default="pinned", help="pinned | default (glibc)")
    ap.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 (autocast)")
    ap.add_argument("--checkpointing", default="off,on", help="activation checkpointing: off,on")
    ap.add_argument("--json-out", default=None, help="also write every row to this JSON file")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(tempfile.gettempdir()) / "tunelab-sizing-bench"
    workdir.mkdir(exist_ok=True)
    errors, rule_errors, rows = [], [], []
    header = (
        f"{'model':13} {'method':6} {'ckpt':4} {'len':>4} {'micro':>5} {'predicted MiB':>13} "
        f"{'measured MiB':>12} {'error':>8} {'x4 rule MiB':>11} {'x4 error':>9} {'step s':>7} "
        f"{'tokens/s':>9}"
    )
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    for name in args.models.split(","):
        arch, targets, lengths, micro = MODELS[name]
        if args.lengths:
            lengths = [int(x) for x in args.lengths.split(",")]
        micro = args.micro_batch or micro
        model = model_section(name, workdir)
        for method in args.methods.split(","):
            cfg = config(model, method, targets, arch == "encoder", args.threads, args.precision)
            for ckpt in (c == "on" for c in args.checkpointing.split(",")):
                for length in lengths:
                    spec = {
                        "label": f"{name} {method} ckpt={ckpt} len={length}",
                        "config": cfg,
                        "labels": ["a", "b", "c", "d", "e"] if arch == "encoder" else None,
                        "seq_len": length,
                        "micro_batch": micro,
                        "checkpointing": ckpt,
                        "packing": True,
                        "loss_fraction": 1.0,
                        "num_threads": args.threads,
                        "device": args.device,
                        "allocator": args.allocator,
                        "precision": args.precision,
                    }
                    result = measure_in_subprocess(spec, timeout_s=3600)
                    if result.get("status") != "ok":
                        print(f"{spec['label']}: {result.get('status')} {result.get('reason')}")
                        continue
                    facts = ModelFacts.from_dict(result["facts"])
                    device = result["device"]
                    case = Case(
                        seq_len=length,
                        micro_batch=micro,
                        checkpointing=ckpt,
                        packing=arch == "causal_lm",
                        precision=args.precision,
                        device=device,
                        cuda_major=result["measured"].get("cuda_major") or 9,
                    )
                    m = result["measured"]
                    row = compare_row(facts, case, m, device)
                    err, rule = row["error_pct"], row["rule_x4"]
                    errors.append(err)
                    rule_errors.append(rule["error_pct"])
                    rows.append({"label": spec["label"], "device": device, **row, "measured": m})
                    if args.json_out:  # after every row: a run stopped midway keeps its rows
                        Path(args.json_out).write_text(json.dumps(rows, indent=1, default=str))
                    print(
                        f"{name:13} {method:6} {'on' if ckpt else 'off':4} {length:>4} "
                        f"{micro:>5} {row['predicted']['compared'] / 2**20:>13.1f} "
                        f"{m['compared'] / 2**20:>12.1f} {err:>+7.1f}% "
                        f"{rule['bytes'] / 2**20:>11.1f} {rule['error_pct']:>+8.1f}% "
                        f"{m['step_s']:>7.3f} {m['tokens_per_s']:>9.0f}",
                        flush=True,
                    )
    if not errors:
        print("no row measured")
        return 1
    print(f"{len(errors)} rows in {time.perf_counter() - started:.0f} s")
    print(
        f"max_error_pct={max(abs(e) for e in errors):.1f} "
        f"rule_x4_max_error_pct={max(abs(e) for e in rule_errors):.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
