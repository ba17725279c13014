"""Per-rank host memory of loading a base under FSDP: sharded loading against the whole load.

Workload: SmolLM2-135M-Instruct (the packaged GGUF, converted once to safetensors) in fp32
(538 MB of weights), LoRA r=8 on q/k/v/o, an extraction study of 32 synthetic emails, sequence
length 128, micro batch 1 per rank, 4 optimizer steps. Sides, each in fresh processes:

- one process (`--strategy single`): the reference for memory;
- FSDP on N CPU ranks (gloo) loading the whole base on every rank, then broadcasting rank 0's
  weights and sharding (TUNELAB_FSDP_LOAD=replicated);
- FSDP on N ranks with sharded loading: the model built as a skeleton, each rank reading only
  its rows of the safetensors files (tunelab's default under FSDP).

Each rank resets its peak resident memory (Linux `/proc/self/clear_refs`) just before the model
is built and reads it (`VmHWM`) after loading (load peak) and after the first optimizer step:
the peak from the start of loading to the first step. At 2 ranks a peer side runs the sharded
load with glibc's own malloc policy (`TUNELAB_RANK_MALLOC=default`), which every rank otherwise
replaces with a fixed mmap threshold. The fixed overhead is each process's resident memory at that start
(torch, transformers, the tokenizer and the encoded data), printed per side. The losses of the
4 steps of the sharded side must equal the whole-load side's at the same N, exactly.

A second measurement times the two ways to give ranks their shards (`--strategy` sides above use
per-rank reads): every rank reading its own rows, against rank 0 reading each tensor whole and
scattering the rows through the process group.

    python benchmarks/fsdp_load.py                 # N = 2 and 4
    python benchmarks/fsdp_load.py --nproc 2       # N = 2 only

Last line: `per_rank_peak_over_single=R losses_equal=true|false`, R the largest rank's peak over
the single process's peak, at 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

STEPS = 4
MB = 1024 * 1024


def vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def make_study(root: Path) -> Path:
    from tunelab.core.assets import smollm2_gguf
    from tunelab.demo.studies import write_synthetic_email_study
    from tunelab.lib.models import convert_gguf

    model = convert_gguf(*smollm2_gguf())
    adaptation = {
        "method": "lora",
        "rank": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "dropout": 0.0,
    }
    training = {
        "micro_batch_size": 1,
        "grad_accum_steps": 1,
        "max_steps": STEPS,
        "packing": False,
        "num_threads": 1,
        "eval_every_steps": 0,
    }
    model_section = {"path": str(model), "dtype": "float32"}
    return write_synthetic_email_study(
        root, "fsdp-load", model_section, adaptation=adaptation, training=training, labels=False
    )


def worker(study_dir: Path, out: Path, strategy_name: str) -> None:
    """One rank (or the single process): build, wrap, 4 steps; write its figures."""
    import torch

    from tunelab.core.study import Study
    from tunelab.lib.models import compute_device
    from tunelab.stages.train.build import build_loop, build_model
    from tunelab.stages.train.loop import TrainState, train_loop
    from tunelab.stages.train.parallel import make_strategy
    from tunelab.stages.train.stage import _encode, prepare_run

    torch.set_num_threads(1)
    strategy = make_strategy(strategy_name) if strategy_name != "single" else None
    rank = strategy.rank if strategy else 0
    world = strategy.world_size if strategy else 1
    sets = [f"training.micro_batch_size={2 // world if world <= 2 else 1}"]
    study = Study.open(study_dir, sets)
    prep = prepare_run(study)
    _encode(prep)
    reset_peak()
    start_kb = vm_kb("VmRSS")
    t0 = time.perf_counter()
    model, _ = build_model(prep.base, prep.cfg, prep.labels, compute_device(), strategy)
    loop = build_loop(model, prep.cfg.training, prep.train, architecture="causal_lm",
                      pad_id=prep.tokenizer.pad_token_id or 0, total_steps=STEPS,
                      strategy=strategy)  # fmt: skip
    load_s = time.perf_counter() - t0
    load_peak_kb = vm_kb("VmHWM")
    losses: list[float] = []
    peak: dict[str, int] = {}

    def on_step(state, row) -> None:
        losses.append(row["loss"])
        if state.step == 1:
            peak["kb"] = vm_kb("VmHWM")
            peak["anon_kb"], peak["file_kb"] = vm_kb("RssAnon"), vm_kb("RssFile")

    train_loop(loop, TrainState(), [on_step])
    figures = {"rank": rank, "world": world, "start_kb": start_kb, "peak_kb": peak["kb"],
               "load_peak_kb": load_peak_kb,
               "anon_kb": peak["anon_kb"], "file_kb": peak["file_kb"],
               "load_s": load_s, "losses": losses,
               "bytes_read": getattr(strategy, "bytes_read", None)}  # fmt: skip
    if strategy is not None and strategy_name == "fsdp":
        figures.update(time_shard_reads(prep.base.path, strategy))
    (out / f"rank-{rank}.json").write_text(json.dumps(figures))


def time_shard_reads(folder: Path, strategy) -> dict[str, float]:
    """Seconds to give every rank its rows of every weight: each rank reading its own, and
    rank 0 reading each tensor whole and scattering the rows (gloo)."""
    import torch
    import torch.distributed as dist

    from tunelab.lib.models.skeleton import WeightFiles
    from tunelab.stages.train.sharded_load import rows_of

    files = WeightFiles(folder)
    keys = sorted(files.file_of)
    rank, world = strategy.rank, strategy.world_size
    shapes = {}
    from safetensors import safe_open

    for k in keys:
        with safe_open(str(files.file_of[k]), framework="pt") as f:
            shapes[k] = f.get_slice(k).get_shape()
    dist.barrier()
    t0 = time.perf_counter()
    for k in keys:
        files.read_rows(k, *rows_of(shapes[k][0], rank, world), torch.float32)
    dist.barrier()
    own = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys:
        n, rest = shapes[k][0], shapes[k][1:]
        per = -(-n // world)
        out = torch.empty((per, *rest), dtype=torch.float32)
        parts = None
        if rank == 0:
            whole = files.read_rows(k, 0, n, torch.float32)
            padded = torch.zeros((per * world, *rest), dtype=torch.float32)
            padded[:n] = whole
            parts = list(padded.chunk(world))
        dist.scatter(out, parts, src=0)
    dist.barrier()
    return {"own_reads_s": own, "scatter_s": time.perf_counter() - t0}


def run_side(
    study: Path,
    nproc: int,
    load: str,
    malloc: str = "tunelab",
    strategy: str = "fsdp",
    ddp_start: str = "tunelab",
) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="fsdp-load-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TUNELAB_FSDP_LOAD": load}
    if malloc == "default":  # the peer: glibc's own mmap threshold in the ranks
        env["TUNELAB_RANK_MALLOC"] = "default"
    if ddp_start == "broadcast-all":  # the peer: DDP's own start-up broadcast of every weight
        env["TUNELAB_DDP_START"] = "broadcast-all"
    me = [str(Path(__file__).resolve()), "--worker", str(study), str(out)]
    if nproc == 1:
        cmd = [sys.executable, *me, "single"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), *me, strategy]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--ddp", action="store_true", help="DDP's ranks' memory, file-backed or own")
    ap.add_argument("--worker", nargs=3, metavar=("STUDY", "OUT", "STRATEGY"))
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]), args.worker[2])
        return
    study = make_study(Path(tempfile.mkdtemp(prefix="fsdp-load-study-")) / "s")
    single = run_side(study, 1, "sharded")[0]
    if args.ddp:
        return ddp_sides(study, single)
    weights_mb = sum(p.stat().st_size for p in Path(yaml.safe_load(
        (study / "study.yaml").read_text())["model"]["path"]).glob("*.safetensors")) / MB  # fmt: skip
    print(f"weights {weights_mb:.0f} MB (fp32); fixed overhead = resident memory at the start of "
          f"loading (libraries, tokenizer, data)")  # fmt: skip
    print(
        "| side | ranks | per-rank peak MB (max) | overhead MB | load peak - overhead MB | "
        "weights/N MB | step peak - load peak MB | load s | read s (own rows / scatter) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    row(single, [single], "one process", weights_mb)
    equal_at_2, ratio_at_2 = True, None
    for n in args.nproc:
        whole = run_side(study, n, "replicated")
        sharded = run_side(study, n, "sharded")
        row(whole[0], whole, "FSDP, whole load", weights_mb)
        row(sharded[0], sharded, "FSDP, sharded load", weights_mb)
        if n == 2:
            peer = run_side(study, n, "sharded", malloc="default")
            row(peer[0], peer, "FSDP, sharded load, glibc's own malloc policy", weights_mb)
        same = all(w["losses"] == s["losses"] for w, s in zip(whole, sharded, strict=True))
        print(f"N={n}: losses of {STEPS} steps equal (sharded vs whole load): {same}; "
              f"sharded {sharded[0]['losses']}")  # fmt: skip
        if n == 2:
            equal_at_2 = same
            ratio_at_2 = max(r["peak_kb"] for r in sharded) / single["peak_kb"]
    if ratio_at_2 is None:
        raise SystemExit("--nproc must include 2 for the last line")
    print(f"per_rank_peak_over_single={ratio_at_2:.3f} losses_equal={str(equal_at_2).lower()}")


def ddp_sides(study: Path, single: dict) -> None:
    """Under DDP every rank loads the whole base: how much of a rank's memory after its first
    step is the safetensors files mapped (one copy in the page cache, shared by the node's
    ranks) and how much is its own."""
    ddp = run_side(study, 2, "sharded", strategy="ddp")
    peer = run_side(study, 2, "sharded", strategy="ddp", ddp_start="broadcast-all")
    print("| side | rank | resident MB | own (anonymous) MB | file-backed MB |")
    print("|---|---|---|---|---|")
    sides = [("one process", single)] + [("DDP, trainable tensors broadcast", r) for r in ddp]
    sides += [("DDP's own start-up broadcast of every weight", r) for r in peer]
    same = [r["losses"] for r in ddp] == [r["losses"] for r in peer]
    for side, r in sides:
        rss = r["anon_kb"] + r["file_kb"]
        print(f"| {side} | {r['rank']} | {rss / 1024:.0f} | {r['anon_kb'] / 1024:.0f} | "
              f"{r['file_kb'] / 1024:.0f} |")  # fmt: skip
    own = sum(r["anon_kb"] for r in ddp) / 1024
    shared = max(r["file_kb"] for r in ddp) / 1024
    peer_own = sum(r["anon_kb"] for r in peer) / 1024
    print(f"ddp_node_own_mb={own:.0f} peer_node_own_mb={peer_own:.0f} "
          f"ddp_node_file_backed_mb={shared:.0f} losses_equal={str(same).lower()}")  # fmt: skip


def row(first: dict, ranks: list[dict], side: str, weights_mb: float) -> None:
    worst = max(ranks, key=lambda r: r["peak_kb"])
    reads = (f"{first['own_reads_s']:.2f} / {first['scatter_s']:.2f}"
             if "own_reads_s" in first else "")  # fmt: skip
    print(
        f"| {side} | {len(ranks)} | {worst['peak_kb'] / 1024:.0f} | "
        f"{worst['start_kb'] / 1024:.0f} | "
        f"{(worst['load_peak_kb'] - worst['start_kb']) / 1024:.0f} | "
        f"{weights_mb / len(ranks):.0f} | {(worst['peak_kb'] - worst['load_peak_kb']) / 1024:.0f} | "
        f"{max(r['load_s'] for r in ranks):.1f} | {reads} |"
    )


if __name__ == "__main__":
    main()
