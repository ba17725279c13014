"""The GPU plan's step time against every measured GPU step in the repository.

    python benchmarks/gpu_projection.py                        # the rows of gpu_measured.json
    python benchmarks/gpu_projection.py --rows OUT/sizing-bf16.json --gpu H200   # fresh rows

Each row is one optimizer step that `benchmarks/sizing_accuracy.py` timed on a GPU (a published
shape with random weights, LoRA r=8 on q and v or full fine-tuning, activation checkpointing off
or on, packed equal-length examples, bf16 autocast). The projection is `tunelab plan --gpu`'s own
(`tunelab.stages.plan.project.step_time`) from the shape's config alone: FLOPs over peak x utilization
(the catalog's default for the GPU's architecture and the method), or the host's time to issue
the kernels when that is longer. For each row it prints the measured and projected step, the
error ((projected - measured) / measured), what bound the projection, and the utilization
assumed; the last line reads `max_error_pct=E rows=N`.

Two constants of the catalog were set from two of these rows (the Hopper full-fine-tuning
utilization from the Llama-3.2-1B step without checkpointing, the host's time per block from the
SmolLM2-135M full step without checkpointing): those rows test nothing; the other rows do.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from sizing_accuracy import SHAPES
from tunelab.core.config_training import AdaptationConfig
from tunelab.stages.plan.catalog import default_utilization, find_gpu
from tunelab.stages.plan.figures import SplitCounts
from tunelab.stages.plan.project import Fit, StudyShape, step_time
from tunelab.stages.plan.shapes import facts_from_config

HERE = Path(__file__).resolve().parent
# the rows whose measurement set a catalog constant
CALIBRATION = {("llama1b-shape", "full", False), ("smollm2-shape", "full", False)}


def project_row(row: dict, gpu_id: str) -> dict:
    """The projected step of one measured row, as `tunelab plan --gpu` computes it."""
    gpu = find_gpu(gpu_id)
    adaptation = AdaptationConfig(
        method=row["method"], target_modules=["q_proj", "v_proj"], rank=8, alpha=16
    )
    config = {**SHAPES[row["shape"]], "model_type": "llama"}
    facts = facts_from_config(config, adaptation, architecture="causal_lm")
    n = row["seq_len"]
    shape = StudyShape(
        facts, "the shape's config", (n,), n, n, "the measured length", (n - 1) / n,
        "every position", True, SplitCounts(0, 0, 0), False, 1, 1, 0, 0, "-",
        "bf16", "the measurement's",
    )  # fmt: skip
    util = default_utilization(gpu.arch, row["method"])
    fit = Fit(True, row["micro_batch"], row.get("grad_accum", 1), row["checkpointing"], 0, 0)
    step = step_time(shape, fit, gpu, util, 1, "ddp")
    return {
        **row,
        "projected_s": step.value,
        "range_s": (step.low, step.high),
        "bound": step.bound,
        "utilization": util.value,
        "error_pct": 100 * (step.value - row["step_s"]) / row["step_s"],
        "calibration": (row["shape"], row["method"], row["checkpointing"]) in CALIBRATION,
    }


def fresh_rows(path: Path, micro_batch: int) -> list[dict]:
    """Rows from `sizing_accuracy.py --json-out` (label 'SHAPE METHOD ckpt=B len=N')."""
    out = []
    for r in json.loads(path.read_text()):
        m = re.fullmatch(r"(\S+) (full|lora) ckpt=(True|False) len=(\d+)", r["label"])
        if not m or r.get("device") != "cuda" or m.group(1) not in SHAPES:
            continue
        out.append(
            {
                "shape": m.group(1),
                "method": m.group(2),
                "checkpointing": m.group(3) == "True",
                "seq_len": int(m.group(4)),
                "micro_batch": micro_batch,
                "step_s": r["measured"]["step_s"],
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=Path, default=None, help="sizing_accuracy.py --json-out file")
    ap.add_argument("--gpu", default=None, help="the catalog GPU the fresh rows ran on")
    ap.add_argument("--micro-batch", type=int, default=8, help="the fresh rows' micro-batch")
    args = ap.parse_args()
    if args.rows is not None:
        rows, gpu_id = fresh_rows(args.rows, args.micro_batch), args.gpu or "H200"
        print(f"rows: {args.rows} on {gpu_id}")
    else:
        measured = json.loads((HERE / "gpu_measured.json").read_text())
        rows, gpu_id = measured["rows"], measured["gpu"]
        print(f"rows: {measured['source']}")
    if not rows:
        print("no measured GPU row")
        return 1
    header = (
        f"{'shape':14} {'method':6} {'ckpt':4} {'measured':>8} {'projected':>9} {'range':>13} "
        f"{'error':>7} {'bound':7} {'util':>4}"
    )
    print(header)
    print("-" * len(header))
    results = [project_row(r, gpu_id) for r in rows]
    for r in results:
        lo, hi = r["range_s"]
        print(
            f"{r['shape']:14} {r['method']:6} {'on' if r['checkpointing'] else 'off':4} "
            f"{r['step_s']:>7.3f}s {r['projected_s']:>8.3f}s {lo:>6.3f}-{hi:.3f}s "
            f"{r['error_pct']:>+6.1f}% {r['bound']:7} {r['utilization']:>4.2f}"
            + ("  (set a constant)" if r["calibration"] else "")
        )
    tested = [r for r in results if not r["calibration"]] or results
    worst = max(tested, key=lambda r: abs(r["error_pct"]))
    print(
        f"largest error of the rows that set nothing: {worst['error_pct']:+.1f}% "
        f"({worst['shape']} {worst['method']} ckpt {'on' if worst['checkpointing'] else 'off'})"
    )
    print(f"max_error_pct={abs(worst['error_pct']):.1f} rows={len(tested)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
