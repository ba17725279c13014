"""Packed linear layers against torch's dense `linear`, at the row counts an evaluation passes.

Workload: the linear weights of SmolLM2-135M's shape (30 blocks: q and o 576x576, k and v
192x576, gate and up 1536x576, down 576x1536; and the 49,152x576 vocabulary projection), fp32,
random values, no bias. Each row count is one batch through all of them: 8 and 16 rows (a
decoding step), 256 and 968 (a prefill: 8 prompts of 121 tokens), 4,096 (an encoder
classifier's batch of 32 x 128 tokens). Dense is `nn.Linear`; packed is
`tunelab.lib.inference.packed_linear.PackedLinear` (the weight reordered once for oneDNN, with the decoding
batch, 8, as the layout's hint, as the evaluation packs it). The two alternate on the same
inputs; each figure is the median of `--repeats` rounds; outputs must agree within 1e-4
relative, or the script fails.

    python benchmarks/packed_linear.py [--threads 2] [--repeats 3] [--rows 8,16,256,968,4096]

Last line: `min_ratio_dense_over_packed=X max_ratio_dense_over_packed=Y`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# (out, in): how many of each shape the model has
SHAPES = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1}
HINT_ROWS = 8


def timed(layer, x, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - started) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="8,16,256,968,4096")
    args = ap.parse_args()

    import torch

    from tunelab.lib.inference.packed_linear import PackedLinear, packing_unavailable

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = {}
    for out_f, in_f in SHAPES:
        dense = torch.nn.Linear(in_f, out_f, bias=False).eval()
        layers[(out_f, in_f)] = (dense, PackedLinear(dense, HINT_ROWS))
    reason = packing_unavailable(torch.nn.Sequential(*(d for d, _ in layers.values())))
    if reason:
        print(f"packing unavailable: {reason}")
        return 1
    print(f"{args.threads} threads, {args.repeats} rounds, layout hint {HINT_ROWS} rows")
    print(f"{'rows':>6} {'dense ms':>10} {'packed ms':>10} {'ratio':>7}")
    ratios = []
    for rows in (int(r) for r in args.rows.split(",")):
        dense_s, packed_s = [], []
        for _ in range(args.repeats):
            total_d = total_p = 0.0
            for (out_f, in_f), (dense, packed) in layers.items():
                x = torch.randn(rows, in_f)
                calls = max(1, min(50, int(2e9 / (2 * rows * in_f * out_f))))
                with torch.inference_mode():
                    want, got = dense(x), packed(x)
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                        print(f"packed output differs at {rows} rows, shape {out_f}x{in_f}")
                        return 1
                    count = SHAPES[(out_f, in_f)]
                    total_d += timed(dense, x, calls) * count
                    total_p += timed(packed, x, calls) * count
            dense_s.append(total_d)
            packed_s.append(total_p)
        d, p = statistics.median(dense_s), statistics.median(packed_s)
        ratios.append(d / p)
        print(f"{rows:>6} {1000 * d:>10.1f} {1000 * p:>10.1f} {d / p:>7.2f}", flush=True)
    print(
        f"min_ratio_dense_over_packed={min(ratios):.2f} "
        f"max_ratio_dense_over_packed={max(ratios):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
