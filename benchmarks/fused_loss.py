"""Memory and time of the loss at the LM head: fused linear cross-entropy against the others.

    python benchmarks/fused_loss.py                       # SmolLM2-135M's head, 2,048 rows
    python benchmarks/fused_loss.py --hidden 2048 --vocab 128256 --rows 1024   # Llama-3's

One forward and backward of the summed cross-entropy of `head(hidden)` at the loss positions
(hidden [rows, hidden] requires a gradient, the head is frozen as under LoRA), each variant in a
fresh process, fp32 on CPU:
- full: `F.cross_entropy(F.linear(hidden, W).float(), targets)`: the whole [rows, vocab] logits
  and log-probabilities (what a loop without chunking does at the loss positions);
- chunked: tunelab's path for a head that is not a plain linear layer (LoRA on lm_head): above
  2^26 logits, chunks under activation checkpointing, recomputed in backward;
- fused: `tunelab.stages.train.losses.linear_cross_entropy_sum`, chunks of 2^22 logits (at least 256
  rows) whose gradients are made in the forward pass.

Memory is the process's peak RSS above its RSS once the inputs exist, with glibc returning
every large block to the system at once (MALLOC_MMAP_THRESHOLD_=65536), so the peak is what the
variant had alive at its largest moment. Beside it, the sizing model's prediction of the same
term (`tunelab.stages.sizing.memory.logits_bytes`: "fused", "chunked", "model" for full). The last
line reads `fused_vs_full_memory=X fused_vs_chunked_memory=Y fused_vs_full_time=Z
fused_vs_chunked_time=W max_rel_diff=D` (loss and gradient against full).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("full", "chunked", "fused")


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_variant(name: str, rows: int, hidden: int, vocab: int, repeats: int) -> dict:
    """One variant in this process: peak RSS increase, best time, loss and gradient."""
    import torch
    import torch.nn.functional as F

    from tunelab.stages.train import losses

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():  # in place: no temporary raises the peak before the measurement
        head.weight.normal_(generator=gen).div_(hidden**0.5)
    head.weight.requires_grad_(False)
    x = torch.randn(rows, hidden, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)

    def step() -> tuple[float, torch.Tensor]:
        h = x.clone().requires_grad_()
        if name == "full":
            loss = F.cross_entropy(F.linear(h, head.weight).float(), targets, reduction="sum")
        elif name == "chunked":
            loss = losses.cross_entropy_sum(wrapped(head), h, targets)
        else:
            loss = losses.cross_entropy_sum(head, h, targets)
        loss.backward()
        return loss.item(), h.grad

    before = rss_peak_mb()
    loss, grad = step()
    increase = rss_peak_mb() - before
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return {
        "increase_mb": increase,
        "seconds": best,
        "loss": loss,
        "grad": grad.flatten()[:: max(1, grad.numel() // 4096)].tolist(),
        "grad_scale": float(grad.abs().max()),
    }


def wrapped(head):
    """The head seen as another module (as peft's LoRA layer is): the chunked path."""
    import torch

    class Head(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.out_features = inner.out_features

        def forward(self, h):
            return self.inner(h)

    return Head(head)


def predicted_mb(rows: int, hidden: int, vocab: int) -> dict[str, float]:
    """The sizing model's loss term (its largest moment) per variant."""
    from tunelab.stages.sizing.memory import Case, ModelFacts, logits_bytes

    facts = ModelFacts("llama", "causal_lm", hidden, 4 * hidden, 1, 8, 8, hidden // 8, vocab)
    case = Case(seq_len=rows + 1, micro_batch=1)
    out = {}
    for name, route in (("full", "model"), ("chunked", "chunked"), ("fused", "fused")):
        b = logits_bytes(facts, case, route)
        out[name] = max(b["forward"], b["backward"]) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="loss positions")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        import torch

        torch.set_num_threads(args.threads)
        res = run_variant(args.variant, args.rows, args.hidden, args.vocab, args.repeats)
        print("RESULT " + json.dumps(res))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    results = {}
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", name, "--rows", str(args.rows)]
        cmd += ["--hidden", str(args.hidden), "--vocab", str(args.vocab)]
        cmd += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"variant {name} failed")
        results[name] = json.loads(line[-1][len("RESULT ") :])
    predicted = predicted_mb(args.rows, args.hidden, args.vocab)
    full = results["full"]
    print(
        f"loss at the head: {args.rows} rows, hidden {args.hidden}, vocabulary {args.vocab:,} "
        f"({args.rows * args.vocab * 4 / 2**20:,.0f} MB of fp32 logits whole), "
        f"{args.threads} threads"
    )
    print(
        f"{'variant':<8} {'peak +MB':>9} {'predicted MB':>13} {'s':>7} {'loss':>14} {'rel diff':>9}"
    )
    worst = 0.0
    for name, r in results.items():
        diff = abs(r["loss"] - full["loss"]) / (1 + abs(full["loss"]))
        g = max(abs(a - b) for a, b in zip(r["grad"], full["grad"], strict=True))
        diff = max(diff, g / (1 + full["grad_scale"]))
        worst = max(worst, diff) if name == "fused" else worst
        print(
            f"{name:<8} {r['increase_mb']:>9.0f} {predicted[name]:>13.0f} {r['seconds']:>7.3f} "
            f"{r['loss']:>14.4f} {diff:>9.1e}"
        )
    fused, chunked = results["fused"], results["chunked"]
    print(
        f"fused_vs_full_memory={fused['increase_mb'] / full['increase_mb']:.2f} "
        f"fused_vs_chunked_memory={fused['increase_mb'] / chunked['increase_mb']:.2f} "
        f"fused_vs_full_time={fused['seconds'] / full['seconds']:.2f} "
        f"fused_vs_chunked_time={fused['seconds'] / chunked['seconds']:.2f} "
        f"max_rel_diff={worst:.1e}"
    )


if __name__ == "__main__":
    main()
