"""Evaluation by generation: tunelab against plain transformers `generate` on the extraction demo.

Workload: the extraction demo's study (SmolLM2-135M-Instruct from its packaged GGUF, LoRA r=8
on every linear layer trained as the demo trains it, SpamAssassin emails -> JSON), its
validation split as the evaluation takes it (`evaluation.max_examples`, 20), greedy decoding,
`evaluation.batch_size` 8 and `max_new_tokens` 96.

- tunelab: `tunelab.stages.evaluate.stage.evaluate_model` on the run's model as `tunelab eval` loads it
  (peft, unmerged): it builds its merged copy and checks it on the first batch (both counted).
- `--baseline`: the untouched base model instead, as `tunelab baseline` evaluates it (tunelab
  builds its packed copy and checks it the same way); the peer is `generate` on that model.
- peer: the same peft model, unmerged, `model.generate` over the split in its order, batches of
  the same size, left padding, the same prompts (tunelab's own prompt tokens), greedy, EOS.

The outputs must be identical, or the script fails: each peer output, cut where tunelab's ends
an extraction answer (the token that completes the JSON object, since nothing after it is read),
must equal tunelab's raw output, and the peer's whole output must be judged to the same
prediction. tokens/s counts the answer tokens (the same for both).

The study and its trained adapter are made once (`tunelab register`, `data`, `train`, each in its
own process, about 5 minutes on 2 cores) in `$TUNELAB_CACHE/bench/generation` (default
`~/.cache/tunelab`), then reused. Sides alternate over `--repeats` rounds; the ratio is the
median of the rounds' ratios, printed with their spread.

    python benchmarks/generation.py [--repeats 3] [--threads 2] [--study DIR]

Last line: `ratio_vs_hf_generate=X identical_outputs=true|false`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml


def cache_study(folder: Path) -> Path:
    """The demo's extraction study in `folder`, with one completed training run."""
    from tunelab.demo.studies import extraction_study

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def tunelab(*args: str) -> None:
        cmd = [sys.executable, "-m", "tunelab", args[0], "--study", str(folder), *args[1:]]
        subprocess.run(cmd, env=env, check=True)

    if not (folder / "study.yaml").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "study.yaml").write_text(
            yaml.safe_dump(extraction_study(folder), sort_keys=False)
        )
        tunelab("register")
        tunelab("data")
    from tunelab.core.study import Study

    study = Study.open(folder)
    if not [r for r in study.list_runs() if r.kind == "train" and r.status == "completed"]:
        print("training the demo's adapter once (about 5 minutes on 2 cores) ...", flush=True)
        # a benchmark of generation, not a study: no smoke or baseline (the reason is recorded)
        why = "benchmark: generation speed of a trained adapter"
        tunelab("train", "--name", "bench", "--other-platform", "--why", why)
    return folder


def answer_tokens(tokenizer, tokens: list[int]) -> list[int]:
    """The tokens up to the one that completes the JSON answer (all of them if none does)."""
    from tunelab.lib.tasks.json_text import answer_complete

    for k in range(1, len(tokens) + 1):
        if answer_complete(tokenizer.decode(tokens[:k], skip_special_tokens=True)):
            return tokens[:k]
    return tokens


def hf_generate(model, tokenizer, pre, rows, batch_size: int, max_new_tokens: int):
    """The peer: plain `generate`, the split in its order. Returns the new tokens per row (cut
    at EOS) and the seconds."""
    import torch

    started = time.perf_counter()
    prompts = [pre.prompt_ids(r, generate=max_new_tokens) for r in rows]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out_tokens = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer.pad(
            {"input_ids": prompts[i : i + batch_size]}, padding=True, return_tensors="pt"
        )
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for seq in out[:, enc["input_ids"].shape[1] :].tolist():
            out_tokens.append(seq[: seq.index(eos)] if eos in seq else seq)
    return out_tokens, time.perf_counter() - started


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--study", type=Path, default=None)
    ap.add_argument("--draft-tokens", type=int, default=None, help="evaluation.draft_tokens")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="the untouched base model on both sides, as `tunelab baseline` evaluates it",
    )
    args = ap.parse_args()

    import torch

    from tunelab.core.study import Study
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.evaluate.predict import judge_output
    from tunelab.stages.evaluate.stage import evaluate_model, load_base_model
    from tunelab.stages.train import load_run_model

    cache = Path(os.environ.get("TUNELAB_CACHE") or Path.home() / ".cache" / "tunelab")
    folder = cache_study(args.study or cache / "bench" / "generation")
    torch.set_num_threads(args.threads)
    # both sides decode with the same thread count (tunelab's default counts free cores)
    overrides = [f"evaluation.num_threads={args.threads}"]
    if args.draft_tokens is not None:
        overrides.append(f"evaluation.draft_tokens={args.draft_tokens}")
    study = Study.open(folder, overrides=overrides)
    run = next(
        r
        for r in sorted(study.list_runs(), key=lambda r: r.created_at, reverse=True)
        if r.kind == "train" and r.status == "completed"
    )
    if args.baseline:
        model, tokenizer, base = load_base_model(study, None)
    else:
        model, tokenizer, base = load_run_model(study, study.get_run(run.id))
    tokenizer.padding_side = "left"
    ev = study.config.evaluation
    rows = load_snapshot(study, run.data_snapshot).rows("validation")[: ev.max_examples]
    task = get_task(study.config)
    pre = Preprocessor(tokenizer, study.config, task, base.architecture)
    print(
        f"study {folder} {'base model' if args.baseline else 'run ' + run.id}: "
        f"{len(rows)} validation examples, batch {ev.batch_size}, "
        f"max_new_tokens {ev.max_new_tokens}, {args.threads} threads",
        flush=True,
    )

    rounds, identical, merge = [], True, None
    for k in range(args.repeats):
        sides = ["hf", "tunelab"] if k % 2 == 0 else ["tunelab", "hf"]
        got = {}
        for side in sides:
            before = load_avg()
            if side == "hf":
                tokens, seconds = hf_generate(
                    model, tokenizer, pre, rows, ev.batch_size, ev.max_new_tokens
                )
                got["hf"] = (tokens, seconds, before)
            else:
                record, preds = evaluate_model(model, tokenizer, base, study, rows, "validation")
                merge = record["merge"]
                draws = record["generation"]["batches"]
                print(
                    "  tunelab batches: "
                    + "; ".join(
                        f"{d['steps']} tokens in {d.get('forwards', d['steps'] - 1) + 1} "
                        f"forwards, {d.get('kept', 0)}/{d.get('proposed', 0)} drafted kept"
                        for d in draws
                    ),
                    flush=True,
                )
                got["tunelab"] = (preds, record["seconds"], before)
        tokens, hf_s, hf_load = got["hf"]
        preds, tl_s, tl_load = got["tunelab"]
        cut = [answer_tokens(tokenizer, t) for t in tokens]
        same_text = [
            tokenizer.decode(c, skip_special_tokens=True) == p["raw_output"]
            for c, p in zip(cut, preds, strict=True)
        ]
        same_pred = [
            judge_output(task, r, tokenizer.decode(t, skip_special_tokens=True))["prediction"]
            == p["prediction"]
            for r, t, p in zip(rows, tokens, preds, strict=True)
        ]
        identical = identical and all(same_text) and all(same_pred)
        answer = sum(len(c) for c in cut)
        rounds.append({"hf_s": hf_s, "tl_s": tl_s, "answer_tokens": answer, "ratio": hf_s / tl_s})
        print(
            f"round {k + 1}: hf generate {len(rows) / hf_s:.3f} ex/s {answer / hf_s:.1f} tok/s "
            f"(load {hf_load}) | tunelab {len(rows) / tl_s:.3f} ex/s {answer / tl_s:.1f} tok/s "
            f"(load {tl_load}) | ratio {hf_s / tl_s:.3f} | identical text "
            f"{sum(same_text)}/{len(rows)}, prediction {sum(same_pred)}/{len(rows)} | peer "
            f"generated {sum(len(t) for t in tokens)} tokens, answers {answer}",
            flush=True,
        )
        if not all(same_text):
            bad = same_text.index(False)
            print(
                f"  first difference, example {rows[bad]['id']}:\n"
                f"    hf:      {tokenizer.decode(cut[bad], skip_special_tokens=True)!r}\n"
                f"    tunelab: {preds[bad]['raw_output']!r}",
                flush=True,
            )
    ratios = [r["ratio"] for r in rounds]
    hf_eps = statistics.median(len(rows) / r["hf_s"] for r in rounds)
    tl_eps = statistics.median(len(rows) / r["tl_s"] for r in rounds)
    answer = rounds[0]["answer_tokens"]
    print(f"merge: {merge}")
    print(
        f"median: hf generate {hf_eps:.3f} ex/s {hf_eps * answer / len(rows):.1f} tok/s, "
        f"tunelab {tl_eps:.3f} ex/s {tl_eps * answer / len(rows):.1f} tok/s; "
        f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}, {len(ratios)} rounds)"
    )
    print(
        f"ratio_vs_hf_generate={statistics.median(ratios):.3f} "
        f"identical_outputs={'true' if identical else 'false'}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
