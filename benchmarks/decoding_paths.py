"""tunelab's decoding paths against `generate` on the same merged model, in one process.

Workload: the extraction demo's evaluation as `benchmarks/generation.py` sets it up (its study,
trained adapter and validation prompts), on the merged copy that evaluation adopts, without the
first batch's check. Paths, interleaved over `--repeats` rounds:

- `generate`: `transformers`' `generate` (the shared prompt start computed in every row);
- `prefix`: `tunelab.lib.inference.decoding.decode` after the prompts' shared start computed once;
- `prefix+draftsN`: the same with `evaluation.draft_tokens` N for each `--draft-tokens` value;
- `prefix+packed` (`--packed`): `prefix` on a second merged copy whose linear layers are packed
  for oneDNN, as the evaluation packs its copy on a CPU (`tunelab.lib.inference.packed_linear`).

Every path must give the same outputs, or the script fails. Prints per round each path's
seconds and prefill seconds, then each path's median and its speedup over `generate`; last line
`speedup_prefix_vs_generate=X identical_outputs=true`.

    python benchmarks/decoding_paths.py [--repeats 3] [--threads 2] [--draft-tokens 1,2] [--packed]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from generation import cache_study


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--study", type=Path, default=None)
    ap.add_argument("--draft-tokens", default="", help="e.g. 1,2 (default: none)")
    ap.add_argument("--packed", action="store_true", help="add the packed copy's path")
    args = ap.parse_args()

    import torch

    import tunelab.lib.inference.generation as generation
    from tunelab.core.study import Study
    from tunelab.lib.inference.eval_copy import merged_copy
    from tunelab.lib.inference.packed_linear import pack_linears
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.train import load_run_model

    cache = Path(os.environ.get("TUNELAB_CACHE") or Path.home() / ".cache" / "tunelab")
    folder = cache_study(args.study or cache / "bench" / "generation")
    torch.set_num_threads(args.threads)
    study = Study.open(folder)
    run = next(
        r
        for r in sorted(study.list_runs(), key=lambda r: r.created_at, reverse=True)
        if r.kind == "train" and r.status == "completed"
    )
    model, tokenizer, base = load_run_model(study, study.get_run(run.id))
    ev = study.config.evaluation
    rows = load_snapshot(study, run.data_snapshot).rows("validation")[: ev.max_examples]
    pre = Preprocessor(tokenizer, study.config, get_task(study.config), base.architecture)
    prompts = [pre.prompt_ids(r, generate=ev.max_new_tokens) for r in rows]
    merged = merged_copy(model)
    drafts = [int(x) for x in args.draft_tokens.split(",") if x]
    least = generation.SHARED_PREFIX_MIN
    # (name, fewest shared tokens that count as a prefix, draft tokens, model)
    paths = [("generate", 10**9, 0, merged), ("prefix", least, 0, merged)]
    paths += [(f"prefix+drafts{n}", least, n, merged) for n in drafts]
    if args.packed:
        packed = merged_copy(model)
        pack_linears(packed, ev.batch_size)
        paths.append(("prefix+packed", least, 0, packed))
    shared = generation.shared_prefix_length(prompts)
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{shared} shared, batch {ev.batch_size}, max_new_tokens {ev.max_new_tokens}, "
        f"{args.threads} threads",
        flush=True,
    )
    seconds: dict[str, list[float]] = {name: [] for name, *_ in paths}
    reference, identical = None, True
    for k in range(args.repeats):
        for name, least, n, on in paths if k % 2 == 0 else paths[::-1]:
            generation.SHARED_PREFIX_MIN = least
            stats: list[dict] = []
            started = time.perf_counter()
            out = generation.generate_outputs(
                on,
                tokenizer,
                prompts,
                max_new_tokens=ev.max_new_tokens,
                batch_size=ev.batch_size,
                stats=stats,
                stop_at_answer=True,
                draft_tokens=n,
            )
            took = time.perf_counter() - started
            reference = reference if reference is not None else out
            identical = identical and out == reference
            seconds[name].append(took)
            prefill = sum(b.get("prefill_s", 0.0) for b in stats)
            passes = [b.get("forwards") for b in stats]
            print(
                f"round {k + 1} {name}: {took:.2f} s, prefill {prefill:.2f} s, decoding passes "
                f"{passes}, load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    base_s = statistics.median(seconds["generate"])
    for name, *_ in paths:
        median = statistics.median(seconds[name])
        print(f"{name}: median {median:.2f} s, speedup over generate {base_s / median:.3f}")
    speedup = base_s / statistics.median(seconds["prefix"])
    print(f"speedup_prefix_vs_generate={speedup:.3f} identical_outputs={str(identical).lower()}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
