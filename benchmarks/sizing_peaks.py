"""The steps that really peak, predicted against measured: a run's worst packed batch and the
evaluation's generation batch (`tunelab.stages.sizing.peaks`), in one measuring process.

    python benchmarks/sizing_peaks.py                          # the tiny Llama widened to h256
    python benchmarks/sizing_peaks.py --hidden 32 --json-out rows.json

The worst batch: micro-batches of unequal lengths, packed into one row, a full fine-tuning step.
The evaluation: `generate` with its KV cache at several batch sizes, prompt lengths and new
tokens. Each row: the predicted and measured increase over the idle process (CPU RSS), and the
error. The last line reads `max_error_pct=E`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tunelab.stages.sizing.memory import Case, ModelFacts, estimate_memory
from tunelab.stages.sizing.peaks import evaluation_increase, worst_case
from tunelab.stages.sizing.processes import measure_configurations

WORST = [[120, 97, 64, 33], [250, 10, 10, 10], [128, 128, 128, 128]]
EVALUATIONS = [(16, 64, 64), (64, 128, 32), (256, 64, 8), (32, 256, 128)]


def _config(model: str, threads: int) -> dict:
    return {
        "name": "sizing-peaks",
        "hypothesis": {"behaviour": "b", "rationale": "r", "expected_effect": "e",
                       "primary_metric": "accuracy"},
        "guardrails": [],
        "data": {"source": {"format": "jsonl", "path": "unused.jsonl"}},
        "model": {"path": model, "architecture": "causal_lm"},
        "adaptation": {"method": "full"},
        "training": {"num_threads": threads, "packing": True},
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from tunelab.lib.models.tiny import save_tiny_llama

    folder = Path(tempfile.mkdtemp(prefix="sizing-peaks-")) / f"llama-h{args.hidden}"
    save_tiny_llama(folder, hidden=args.hidden, layers=4, heads=8)
    cfg = _config(str(folder), args.threads)
    common = {"config": cfg, "num_threads": args.threads, "packing": True, "grad_accum": 1}
    specs = [
        {**common, "label": f"worst {'/'.join(map(str, ls))}", "seq_len": max(ls),
         "micro_batch": len(ls), "peak": "worst_batch", "lengths": ls}
        for ls in WORST
    ]  # fmt: skip
    settings = [
        {"kind": "generation", "batch_size": b, "tokens": p, "max_new_tokens": n}
        for b, p, n in EVALUATIONS
    ]
    specs += [
        {**common, "label": f"eval {s['batch_size']}x{s['tokens']}+{s['max_new_tokens']}",
         "seq_len": s["tokens"], "micro_batch": s["batch_size"], "peak": "evaluation",
         "evaluation": s}
        for s in settings
    ]  # fmt: skip
    results = measure_configurations(specs)
    rows = []
    for spec, r in zip(specs, results, strict=True):
        facts = ModelFacts.from_dict(r["facts"])
        if spec["peak"] == "worst_batch":
            batch = {"lengths": spec["lengths"], "packed": True}
            predicted = estimate_memory(facts, worst_case(Case(1, 1), batch)).peak_increase
        else:
            predicted = evaluation_increase(facts, spec["evaluation"])["increase"]
        measured = (r.get("measured") or {}).get("increase")
        error = 100.0 * (predicted - measured) / measured if measured else None
        rows.append({"label": spec["label"], "status": r["status"], "predicted": predicted,
                     "measured": measured, "error_pct": error})  # fmt: skip
        shown = f"{error:+.1f} %" if error is not None else r["status"]
        print(
            f"{spec['label']:<24} predicted {predicted / 2**20:8.1f} MiB  measured "
            f"{(measured or 0) / 2**20:8.1f} MiB  {shown}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    errors = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    print(f"max_error_pct={max(errors):.1f}" if errors else "max_error_pct=none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
