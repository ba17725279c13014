"""Training throughput: tunelab's loop against Trainer + peft, TRL SFTTrainer and a bare loop.

    python benchmarks/throughput.py            # every side once, each in its own process
    python benchmarks/throughput.py --rounds 3 # three alternating rounds, best per side
    python benchmarks/throughput.py --max-load 1.5  # on a shared machine: wait for quiet
    python benchmarks/throughput.py --device cuda   # the GPU workload below, in bf16

The workload is built once and read by every side. `--device cpu` (the default): a Llama from a
local LlamaConfig (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 8192, random weights),
2,000 synthetic prompt / completion pairs with long-tailed lengths (25 to 509 tokens, median
about 95; loss on the completion only), LoRA r=8 alpha 16 on q,k,v,o, micro-batch 4 x
accumulation 2, 30 optimizer steps, AdamW lr 1e-3 with linear decay, grad clip 1.0, fp32, 2
threads. `--device cuda`: Llama-3.2-1B's published configuration (hidden 2048, 16 layers, 32
heads over 8 kv heads, intermediate 8192, vocabulary 128,256, tied embeddings; written below,
random weights, nothing downloaded) in bf16 weights with bf16 autocast, 2,000 pairs of 32 to
2,047 tokens (median about 350), the same LoRA, micro-batch 8 x accumulation 2, 40 steps of
which the first 5 are a warm-up left out of the timing (kernel selection, compilation).

Sides (each a fresh Python process, run in turn, the order rotating between rounds):
- tunelab: `tunelab.stages.train.loop.train_loop` over `StepSource` (packed, the default), the model
  adapted by `tunelab.lib.models.adapt`; its attention route and loss are chosen as in a run
  (`tunelab.stages.train.losses.check_model`) and printed.
- trainer: transformers Trainer + peft, dynamic padding per micro-batch, the same examples in the
  same order as tunelab (a sequential sampler over tunelab's data order).
- trainer_liger (CUDA): the same with `use_liger_kernel=True` (Liger's fused linear
  cross-entropy, RMSNorm, RoPE, SwiGLU); skipped when liger_kernel is not installed.
- trl_packing: TRL SFTTrainer, `packing=True` (bfd, padding-free), `max_length` 512 (CPU) or
  2048 (CUDA), completion-only loss; its own packing and order, so its loss is not comparable.
- trl_packing_b1 (CPU): the same with 1 packed row per micro-batch (about the size of tunelab's
  micro-batch). `ratio_vs_trl_packing` is against the faster of the two.
- trl_padding_free (CUDA default, CPU optional): TRL `padding_free=True` without packing, on
  FlashAttention-2 (`attn_implementation="flash_attention_2"`) when flash_attn is installed,
  else on sdpa (which keeps packed examples apart with `use_cache=False`).
- bare_packed: a plain PyTorch loop over the same packed micro-batches as tunelab with the
  arithmetic written inline: per-example SDPA, body -> hidden states at loss positions -> head,
  an unfused cross-entropy. What is left between the two is tunelab's machinery (data order,
  collation, token counting, clipping, checks) and its choices of attention route and loss.
- bare_padded (CPU): a plain PyTorch loop over the trainer's padded batches, full logits.
Optional (`--sides`): trl_padded, bare_packed_blockmask (packed with transformers'
block-diagonal mask instead of per-example attention), bare_packed_full (block mask and full
logits), and any side of the other device.

Reported per side: non-padding tokens per second over the timed steps (from the end of the
warm-up, or the start of the first step, to the end of the last; with `--rounds N`, the best
round, the least disturbed by other work on the machine), the process CPU seconds over the same
steps, the final step's loss, peak memory (CPU: peak RSS of the process; CUDA:
max_memory_allocated), and the model-FLOP utilization: useful model FLOP/s as a share of the
matmul peak measured in the same run (fp32 with the threads given on CPU; bf16 8192^3 matmuls
on CUDA), and on CUDA of the GPU's datasheet dense bf16 rate as well (`DATASHEET_BF16_TFLOPS`,
when the GPU is listed). Useful FLOPs are the matmul FLOPs of non-padding tokens, counted for
LoRA (padding does no useful work): frozen decoder linear layers forward and input-gradient
backward (4 x parameters per token: no weight gradient), LoRA forward and backward with its
weight gradients (6 x its parameters per token), causal attention within each example (QK^T and
AV, forward and backward: 6 x heads x head dim x L(L+1) per example and layer), and the frozen
LM head at every non-padding token (4 x hidden x vocab: `% peak`, the share in the last line).
`% peak loss-only` counts the head at the loss positions only, the least the loss needs, which
does not credit tunelab for the head work it skips.

The last line reads `ratio_vs_trainer=X ratio_vs_trl_packing=Y overhead_vs_bare_pct=Z
peak_share_pct=P` (CUDA adds `ratio_vs_trainer_liger`, `ratio_vs_trl_padding_free` and
`mfu_datasheet_pct`); the line before it gives the loss-only share.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA = 8, 16
SEED = 0


@dataclass(frozen=True)
class Shape:
    """A Llama configuration, built with random weights."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Shape("tiny Llama", 256, 4, 4, 4, 688, 8192)
# meta-llama/Llama-3.2-1B config.json: the shape only, weights are random
LLAMA_32_1B = Shape(
    "Llama-3.2-1B",
    hidden=2048,
    layers=16,
    heads=32,
    kv_heads=8,
    intermediate=8192,
    vocab=128256,
    tie_embeddings=True,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


@dataclass(frozen=True)
class Setup:
    """Everything the device changes about the workload."""

    device: str
    shape: Shape
    precision: str  # the dtype of weights and autocast: fp32 | bf16
    length_median: float
    length_min: int
    length_max: int
    micro: int
    accum: int
    steps: int
    warmup: int  # steps before the timed window
    lr: float
    max_len: int  # TRL packing's row length
    sides: list[str] = field(default_factory=list)


CPU_SETUP = Setup(
    "cpu",
    TINY,
    "fp32",
    95,
    25,
    509,
    micro=4,
    accum=2,
    steps=30,
    warmup=0,
    lr=1e-3,
    max_len=512,
    sides=["tunelab", "trainer", "trl_packing", "trl_packing_b1", "bare_packed", "bare_padded"],
)
CUDA_SETUP = Setup(
    "cuda",
    LLAMA_32_1B,
    "bf16",
    350,
    32,
    2047,
    micro=8,
    accum=2,
    steps=40,
    warmup=5,
    lr=2e-4,
    max_len=2048,
    sides=["tunelab", "trainer", "trainer_liger", "trl_packing", "trl_padding_free", "bare_packed"],
)
ALL_SIDES = [
    "tunelab",
    "trainer",
    "trainer_liger",
    "trl_packing",
    "trl_packing_b1",
    "trl_padding_free",
    "trl_padded",
    "bare_packed",
    "bare_padded",
    "bare_packed_blockmask",
    "bare_packed_full",
]
# NVIDIA datasheets, dense bf16 tensor-core rate (no sparsity), TFLOP/s; matched on the name
DATASHEET_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 SXM": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
}


# ------------------------------------------------------------------ workload (parent)


def build_workload(root: Path, setup: Setup, num_examples: int, steps: int) -> dict:
    """Save the model and the examples under `root`; returns the workload description."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunelab.stages.train.batches import DataOrder, Position

    shape = setup.shape
    config = LlamaConfig(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        max_position_embeddings=max(512, setup.length_max + 1),
        tie_word_embeddings=shape.tie_embeddings,
        rope_theta=shape.rope_theta,
        rope_scaling=shape.rope_scaling,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(SEED)
    dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
    with torch.device(setup.device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(root / "model")
    del model
    save_tokenizer(root / "model", shape.vocab)

    rng = np.random.default_rng(SEED)
    lengths = np.rint(rng.lognormal(math.log(setup.length_median), 0.8, num_examples))
    lengths = np.clip(lengths, setup.length_min, setup.length_max)
    ranks = np.arange(3, shape.vocab)
    weights = 1.0 / (ranks - 2 + 10.0) ** 1.1  # Zipf-like: frequent tokens are learnable
    weights /= weights.sum()
    examples = []
    for length in lengths.astype(int).tolist():
        completion = max(2, round(length * rng.uniform(0.2, 0.5)))
        body = rng.choice(ranks, size=length - 2, p=weights).tolist()
        ids = [1, *body, 2]  # BOS ... EOS (the EOS is part of the completion)
        prompt = length - completion
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    per_step = setup.micro * setup.accum
    order, _ = DataOrder(num_examples, SEED).take(Position(), steps * per_step)
    setup_dict = {**asdict(setup), "steps": steps}
    workload = {"examples": examples, "order": order, "steps": steps, "setup": setup_dict}
    (root / "workload.json").write_text(json.dumps(workload))
    used = [examples[i] for i in order]
    micro = setup.micro
    padded = sum(
        max(len(e["input_ids"]) for e in used[k : k + micro]) * len(used[k : k + micro])
        for k in range(0, len(used), micro)
    )
    return {
        "examples": num_examples,
        "length_min": int(lengths.min()),
        "length_median": float(np.median(lengths)),
        "length_max": int(lengths.max()),
        "tokens_in_steps": sum(len(e["input_ids"]) for e in used),
        "padded_tokens_in_steps": padded,
        "loss_share": sum(sum(x != -100 for x in e["labels"][1:]) for e in examples)
        / sum(len(e["input_ids"]) for e in examples),
    }


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the ids (TRL wants one for its pad and EOS ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    tok.save_pretrained(path)


def measure_matmul_peak(threads: int, device: str = "cpu", seconds: float = 3.0) -> float:
    """Best GFLOP/s of large square matmuls: fp32 with `threads` threads on CPU, bf16 on CUDA."""
    import torch

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    best = 0.0
    sizes = (4096, 8192) if cuda else (1024, 2048, 3072)
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)  # warm up
        deadline = time.perf_counter() + seconds / len(sizes)
        while time.perf_counter() < deadline:
            reps = 10 if cuda else 1
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            if cuda:
                torch.cuda.synchronize()
            best = max(best, reps * 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def datasheet_tflops(gpu_name: str) -> float | None:
    """The datasheet dense bf16 rate of the GPU `gpu_name` names, when listed."""
    for key, tflops in DATASHEET_BF16_TFLOPS.items():
        if key.lower() in gpu_name.lower():
            return tflops
    return None


def useful_flops(examples: list[list[int]], shape: Shape, head_all: bool = False) -> float:
    """Matmul FLOPs a LoRA step needs on examples given as [length, loss positions] (see doc)."""
    h, hd = shape.hidden, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    linear = shape.layers * (h * q + 2 * h * kv + q * h + 3 * h * shape.intermediate)
    ins_outs = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    lora = shape.layers * sum(RANK * (i + o) for i, o in (ins_outs[t] for t in TARGETS))
    total = 0.0
    for length, loss in examples:
        total += 4 * linear * length  # forward + input gradients (frozen weights)
        total += 6 * lora * length  # forward + input and weight gradients
        total += 3 * shape.layers * 2 * q * length * (length + 1)  # causal QK^T, AV; fwd + bwd
        total += 4 * h * shape.vocab * (length if head_all else loss)
    return total


# ------------------------------------------------------------------ sides (child processes)


def load_workload(root: Path) -> tuple[dict, Setup]:
    w = json.loads((root / "workload.json").read_text())
    raw = dict(w["setup"])
    raw["shape"] = Shape(**raw["shape"])
    return w, Setup(**raw)


def load_model(root: Path, s: Setup, attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if s.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=dtype, attn_implementation=attn
    )
    return model.to(s.device)


def peft_lora(model):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)  # the same LoRA A initialization on every side
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def segments(batch: dict) -> list[list[int]]:
    """[length, loss positions] of each example in a padded or packed batch."""
    labels = batch["labels"].cpu()
    out = []
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        mask = batch["attention_mask"].cpu()
        for row in range(labels.shape[0]):
            n = int(mask[row].sum())
            out.append([n, int((labels[row, 1:n] != -100).sum())])
        return out
    positions = batch["position_ids"].reshape(-1).tolist()
    flat = labels.reshape(-1).tolist()
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    for s, e in zip(starts[:-1], starts[1:], strict=True):
        out.append([e - s, sum(1 for x in flat[s + 1 : e] if x != -100)])
    return out


def pad_batch(encoded: list[dict]) -> dict:
    """Dynamic padding: right-padded to the longest example of the micro-batch."""
    import torch

    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        labels[row, :n] = torch.tensor(e["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack_batch(encoded: list[dict]) -> dict:
    """One row, positions restarting per example; each example's first label dropped."""
    import torch

    ids, labels, positions = [], [], []
    for e in encoded:
        ids += e["input_ids"]
        labels += [-100, *e["labels"][1:]]
        positions += range(len(e["input_ids"]))
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels]),
        "position_ids": torch.tensor([positions]),
    }


class Steps:
    """Per-step end times, CPU times, tokens and examples of a side (the parent picks the
    timed window); on CUDA each step end waits for the device."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.start = self.cpu_start = 0.0
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.tokens: list[int] = []
        self.seen: list[list[list[int]]] = []
        self._tokens, self._seen = 0, []

    def begin(self) -> None:
        if not self.ends and not self.start:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def count(self, batch: dict) -> None:
        seg = segments(batch)
        self.add(sum(n for n, _ in seg), seg)

    def add(self, tokens: int, seen: list[list[int]]) -> None:
        """Tokens and [length, loss positions] of examples the current step trained on."""
        self._tokens += tokens
        self._seen += seen

    def end(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.tokens.append(self._tokens)
        self.seen.append(self._seen)
        self._tokens, self._seen = 0, []

    def result(self, loss: float, **extra) -> dict:
        return {
            "start": self.start,
            "cpu_start": self.cpu_start,
            "ends": self.ends,
            "cpu_ends": self.cpu_ends,
            "tokens_per_step": self.tokens,
            "seen_per_step": self.seen,
            "loss": loss,
            **extra,
        }


def side_tunelab(root: Path, w: dict, s: Setup) -> dict:
    import torch

    from tunelab.core.config_training import AdaptationConfig, TrainingConfig
    from tunelab.lib.models import adapt
    from tunelab.stages.train.batches import DataOrder, StepSource
    from tunelab.stages.train.compute import describe_compute
    from tunelab.stages.train.loop import (
        Loop,
        TrainState,
        build_optimizer,
        build_scheduler,
        train_loop,
    )

    steps = w["steps"]
    cfg = TrainingConfig(
        seed=SEED,
        micro_batch_size=s.micro,
        grad_accum_steps=s.accum,
        max_steps=steps,
        lr=s.lr,
        schedule="linear",
        grad_clip=1.0,
        precision="auto" if s.device == "cuda" else "fp32",
    )
    assert cfg.packing, "packing is the default"
    torch.manual_seed(SEED)
    model, _ = adapt(
        load_model(root, s),
        AdaptationConfig(method="lora", target_modules=TARGETS, rank=RANK, alpha=ALPHA),
        "causal_lm",
    )
    device = torch.device(s.device)
    examples = w["examples"]
    probe = torch.tensor([examples[0]["input_ids"]])
    how = describe_compute(model, cfg, device, probe, "causal_lm")
    order = DataOrder(len(examples), cfg.seed)
    source = StepSource(examples, order, s.micro, s.accum, 0, "causal_lm", True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)
    scheduler = build_scheduler(optimizer, cfg, steps)
    loop = Loop(model, optimizer, scheduler, source, cfg, steps, "causal_lm")
    clock = Steps(s.device)
    per_step = s.micro * s.accum
    seen = [examples[i] for i in w["order"]]
    rows: list[dict] = []

    def on_step(state, row):
        step = seen[len(rows) * per_step : (len(rows) + 1) * per_step]
        clock.add(row["tokens"], [[len(e["input_ids"]), _loss_positions(e)] for e in step])
        clock.end()
        rows.append(row)

    clock.begin()
    train_loop(loop, TrainState(), [on_step])
    return clock.result(rows[-1]["loss"], batching="packed", compute=how)


def _loss_positions(e: dict) -> int:
    return sum(1 for x in e["labels"][1:] if x != -100)


def bare_loop(root: Path, w: dict, s: Setup, batches: list[list[dict]], loss_fn, per_example=False):
    """A plain loop: AdamW, linear decay, clip 1.0, loss summed then divided by the step's
    loss tokens; bf16 autocast on CUDA."""
    import torch

    from tunelab.stages.train.attention import use_packed_sdpa

    model = peft_lora(load_model(root, s))
    if per_example:
        assert use_packed_sdpa(model.get_base_model())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    steps = len(batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: max(0.0, 1 - k / steps))
    model.train()
    amp = torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.precision == "bf16")
    clock = Steps(s.device)
    loss = float("nan")
    clock.begin()
    for micro_batches in batches:
        loss_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        total = torch.zeros((), device=s.device)
        for b in micro_batches:
            clock.count(b)
            b = {k: v.to(s.device) for k, v in b.items()}
            with amp:
                ce = loss_fn(model, b)
            (ce / loss_tokens).backward()
            total += ce.detach().float()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss = float(total) / loss_tokens
        clock.end()
    return clock.result(loss)


def steps_of(w: dict, s: Setup, collate) -> list[list[dict]]:
    used = [w["examples"][i] for i in w["order"]]
    per_step = s.micro * s.accum
    return [
        [collate(used[k + m : k + m + s.micro]) for m in range(0, per_step, s.micro)]
        for k in range(0, len(used), per_step)
    ]


def side_bare_packed(root: Path, w: dict, s: Setup, per_example: bool = True) -> dict:
    """The loss written inline: body -> hidden states at loss positions -> head."""
    import torch.nn.functional as F

    from tunelab.stages.train.attention import segment_bounds

    def loss_fn(model, b):
        inner = model.get_base_model()
        extra = {"tunelab_segments": segment_bounds(b["position_ids"])}
        hidden = inner.model(
            input_ids=b["input_ids"],
            position_ids=b["position_ids"],
            use_cache=False,
            **(extra if per_example else {}),
        ).last_hidden_state
        labels = b["labels"][:, 1:]
        keep = labels != -100
        logits = inner.lm_head(hidden[:, :-1][keep])  # [loss tokens, vocab]
        return F.cross_entropy(logits.float(), labels[keep], reduction="sum")

    batches = steps_of(w, s, pack_batch)
    return {**bare_loop(root, w, s, batches, loss_fn, per_example), "batching": "packed"}


def side_bare_packed_full(root: Path, w: dict, s: Setup) -> dict:
    import torch.nn.functional as F

    def loss_fn(model, b):
        logits = model(
            input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False
        ).logits
        labels = b["labels"][:, 1:]
        keep = labels != -100
        return F.cross_entropy(logits[:, :-1][keep].float(), labels[keep], reduction="sum")

    return {**bare_loop(root, w, s, steps_of(w, s, pack_batch), loss_fn), "batching": "packed"}


def side_bare_padded(root: Path, w: dict, s: Setup) -> dict:
    import torch.nn.functional as F

    def loss_fn(model, b):
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False
        ).logits
        labels = b["labels"][:, 1:]
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            reduction="sum",
        )

    return {**bare_loop(root, w, s, steps_of(w, s, pad_batch), loss_fn), "batching": "padded"}


class StepClock(Steps):
    """A Steps fed by Trainer callbacks; the loss of each step is summed over its micro-batches
    by the trainer subclasses below."""

    def __init__(self, device: str):
        super().__init__(device)
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                clock.begin()

            def on_step_end(self, args, state, control, **kw):
                clock.end()
                clock.losses.append(float(clock.step_loss))
                clock.step_loss = 0.0

        self.callback = _Callback()
        self.losses: list[float] = []
        self.step_loss = 0.0

    def record(self, inputs: dict, loss) -> None:
        b = {k: v for k, v in inputs.items() if k in ("labels", "attention_mask", "position_ids")}
        if "attention_mask" not in b and "position_ids" not in b:
            raise RuntimeError(f"no example boundaries in a batch with keys {sorted(inputs)}")
        self.count(b)
        self.step_loss = self.step_loss + loss.detach()


def counting(trainer_cls, clock: StepClock):
    class Counting(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen = {
                k: inputs[k] for k in ("labels", "attention_mask", "position_ids") if k in inputs
            }
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            clock.record(seen, loss[0] if isinstance(loss, tuple) else loss)
            return loss

    return Counting


def common_args(s: Setup, w: dict, out: str) -> dict:
    """Training arguments every Trainer-based side shares."""
    return {
        "output_dir": out,
        "gradient_accumulation_steps": s.accum,
        "max_steps": w["steps"],
        "learning_rate": s.lr,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": s.device == "cpu",
        "bf16": s.precision == "bf16",
        "seed": SEED,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def side_trainer(root: Path, w: dict, s: Setup, liger: bool = False) -> dict:
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    if liger:
        require("liger_kernel", "Trainer(use_liger_kernel=True)")
    model = peft_lora(load_model(root, s))
    ordered = [w["examples"][i] for i in w["order"]]
    clock = StepClock(s.device)

    class SameOrder(counting(Trainer, clock)):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            per_device_train_batch_size=s.micro,
            use_liger_kernel=liger,
            **common_args(s, w, out),
        )
        trainer = SameOrder(
            model=model,
            args=args,
            train_dataset=ordered,
            data_collator=pad_batch,
            callbacks=[clock.callback],
        )
        trainer.train()
    return clock.result(clock.losses[-1], batching="padded" + (" + liger" if liger else ""))


def side_trl(root: Path, w: dict, s: Setup, mode: str, micro: int | None = None) -> dict:
    require("trl", "TRL SFTTrainer")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    flash = mode == "padding_free" and s.device == "cuda" and installed("flash_attn")
    model = peft_lora(load_model(root, s, attn="flash_attention_2" if flash else "sdpa"))
    data = Dataset.from_dict(
        {
            "input_ids": [e["input_ids"] for e in w["examples"]],
            "completion_mask": [[int(x != -100) for x in e["labels"]] for e in w["examples"]],
        }
    )
    clock = StepClock(s.device)
    options = {
        "packing": {"packing": True, "packing_strategy": "bfd", "max_length": s.max_len},
        "padding_free": {"padding_free": True, "max_length": None},
        "padded": {"max_length": s.max_len},
    }[mode]
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            per_device_train_batch_size=micro or s.micro,
            gradient_checkpointing=False,
            completion_only_loss=True,
            **common_args(s, w, out),
            **options,
        )
        trainer = counting(SFTTrainer, clock)(
            model=model, args=args, train_dataset=data, callbacks=[clock.callback]
        )
        trainer.train()
    batching = mode.replace("_", "-") + (" + flash-attn 2" if flash else "")
    return clock.result(clock.losses[-1], batching=batching)


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def require(module: str, what: str) -> None:
    if not installed(module):
        print("SKIPPED " + json.dumps({"reason": f"{what} needs {module}, not installed"}))
        raise SystemExit(0)


SIDES = {
    "tunelab": side_tunelab,
    "trainer": side_trainer,
    "trainer_liger": lambda r, w, s: side_trainer(r, w, s, liger=True),
    "trl_packing": lambda r, w, s: side_trl(r, w, s, "packing"),
    "trl_packing_b1": lambda r, w, s: side_trl(r, w, s, "packing", micro=1),
    "trl_padding_free": lambda r, w, s: side_trl(r, w, s, "padding_free"),
    "trl_padded": lambda r, w, s: side_trl(r, w, s, "padded"),
    "bare_packed": side_bare_packed,
    "bare_packed_blockmask": lambda r, w, s: side_bare_packed(r, w, s, per_example=False),
    "bare_packed_full": side_bare_packed_full,
    "bare_padded": side_bare_padded,
}


def run_side(name: str, root: Path, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    w, s = load_workload(root)
    result = SIDES[name](root, w, s)
    if s.device == "cuda":
        result["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(result))


# ------------------------------------------------------------------ report (parent)


def spawn(name: str, root: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONWARNINGS", "ignore")
    cmd = [sys.executable, __file__, "--side", name, "--workdir", str(root)]
    proc = subprocess.run(
        cmd + ["--threads", str(threads)], env=env, capture_output=True, text=True
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(("RESULT ", "SKIPPED ")):
            kind, _, body = line.partition(" ")
            return {**json.loads(body), "skipped": kind == "SKIPPED"}
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
    return {"skipped": True, "reason": f"failed (exit {proc.returncode}): {proc.stderr[-300:]}"}


def timed(res: dict, warmup: int) -> dict:
    """The side's figures over its timed window: the steps after `warmup`."""
    ends, cpu_ends = res["ends"], res["cpu_ends"]
    k = min(warmup, len(ends) - 1)
    start = ends[k - 1] if k else res["start"]
    cpu_start = cpu_ends[k - 1] if k else res["cpu_start"]
    seen = [e for step in res["seen_per_step"][k:] for e in step]
    return {
        "seconds": ends[-1] - start,
        "cpu_s": cpu_ends[-1] - cpu_start,
        "tokens": sum(res["tokens_per_step"][k:]),
        "seen": seen,
        "steps": len(ends) - k,
    }


def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_load(limit: float | None, max_wait_s: float) -> float:
    """Wait (up to `max_wait_s`) until the 1-minute load average is below `limit`; returns the
    seconds waited. Two threads that other work keeps descheduling spin at every barrier, which
    makes a side several times slower: a number measured then says nothing about the code."""
    waited = 0.0
    while limit is not None and load_average() >= limit and waited < max_wait_s:
        time.sleep(5)
        waited += 5
    return waited


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sides", default=None, help=",".join(ALL_SIDES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per side")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="before each side, wait until the 1-minute load average is below this",
    )
    parser.add_argument("--max-wait", type=float, default=600, help="seconds, per side")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.side:
        run_side(args.side, Path(args.workdir), args.threads)
        return
    setup = CPU_SETUP if args.device == "cpu" else CUDA_SETUP
    sides = args.sides.split(",") if args.sides else list(setup.sides)
    unknown = [s for s in sides if s not in SIDES]
    if unknown or "tunelab" not in sides:
        raise SystemExit(f"--sides: unknown {unknown} or no tunelab; choose from {ALL_SIDES}")
    steps = args.steps or setup.steps
    from rich.console import Console

    console = Console(width=150)
    with tempfile.TemporaryDirectory(prefix="tunelab-throughput-") as tmp:
        root = Path(tmp)
        facts = build_workload(root, setup, args.examples, steps)
        load_before = load_average()
        peaks = [measure_matmul_peak(args.threads, setup.device)]
        console.print(
            f"workload: {setup.shape.name} in {setup.precision} on {setup.device}; "
            f"{facts['examples']} examples, lengths {facts['length_min']}-"
            f"{facts['length_max']} (median {facts['length_median']:.0f}), "
            f"{facts['loss_share']:.0%} of tokens carry loss; {steps} steps hold "
            f"{facts['tokens_in_steps']:,} tokens ({facts['padded_tokens_in_steps']:,} padded), "
            f"{min(setup.warmup, steps - 1)} of them warm-up; matmul peak {peaks[0]:.1f} GFLOP/s "
            f"({args.threads} threads); load {load_before:.2f}"
        )
        runs = run_rounds(console, sides, root, args)
        peaks.append(measure_matmul_peak(args.threads, setup.device))
    report(console, setup, steps, runs, peaks, load_before, facts, args)


def run_rounds(console, sides: list[str], root: Path, args) -> dict[str, list[dict]]:
    _, setup = load_workload(root)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for name in order:
            waited = wait_for_load(args.max_load, args.max_wait)
            load_at_start = load_average()
            res = spawn(name, root, args.threads)
            if res["skipped"]:
                console.print(f"  round {r + 1} {name:<17} skipped: {res['reason']}")
                runs[name].append(res)
                continue
            res.update(timed(res, setup.warmup), load_at_start=load_at_start, waited_s=waited)
            runs[name].append(res)
            console.print(
                f"  round {r + 1} {name:<17} {res['tokens'] / res['seconds']:8.0f} tok/s  "
                f"loss {res['loss']:.4f}  (load {load_at_start:.2f} -> {load_average():.2f}"
                + (f", waited {waited:.0f} s" if waited else "")
                + ")"
            )
            if res.get("compute"):
                c = res["compute"]
                console.print(
                    f"    {name}: attention {c.get('attention')}, cross-entropy "
                    f"{c.get('cross_entropy')}, precision {c['precision']['used']}"
                )
    return runs


def summarize(setup: Setup, runs: dict[str, list[dict]], peak_gflops: float, datasheet) -> dict:
    summary: dict[str, dict] = {}
    for name, results in runs.items():
        done = [x for x in results if not x["skipped"]]
        if not done:
            summary[name] = {"skipped": results[0].get("reason", "skipped")}
            continue
        rates = [x["tokens"] / x["seconds"] for x in done]
        best = done[rates.index(max(rates))]  # the least disturbed round
        seconds = best["seconds"]

        def share(head_all: bool, peak: float, best=best, seconds=seconds) -> float:
            return 100 * useful_flops(best["seen"], setup.shape, head_all) / seconds / 1e9 / peak

        summary[name] = {
            "batching": best["batching"],
            "tokens": best["tokens"],
            "seconds": seconds,
            "tokens_per_s": best["tokens"] / seconds,
            "cpu_s": best["cpu_s"],
            "all_tokens_per_s": rates,
            "loss": best["loss"],
            "peak_memory_mb": max(x["peak_memory_mb"] for x in done),
            "share_pct": share(False, peak_gflops),
            "share_head_all_pct": share(True, peak_gflops),
            "mfu_datasheet_pct": share(True, datasheet * 1000) if datasheet else None,
            "compute": best.get("compute"),
        }
    return summary


def report(console, setup, steps, runs, peaks, load_before, facts, args) -> None:
    from rich.table import Table

    gpu_name, datasheet = "", None
    if setup.device == "cuda":
        import torch

        gpu_name = torch.cuda.get_device_name()
        datasheet = datasheet_tflops(gpu_name)
    peak = max(peaks)
    summary = summarize(setup, runs, peak, datasheet)
    ours = summary["tunelab"]
    if "skipped" in ours:
        raise SystemExit(f"the tunelab side did not run: {ours['skipped']}")
    memory = "peak RSS MB" if setup.device == "cpu" else "max alloc MB"
    title = f"throughput ({steps} steps, {setup.precision}, {setup.device}"
    title += f", {args.threads} threads)" if setup.device == "cpu" else f", {gpu_name})"
    table = Table(title=title)
    cols = ["side", "batching", "tokens", "s", "CPU s", "tok/s", "tunelab x", "final loss"]
    cols += [memory, "% peak", "% peak loss-only"] + (["% datasheet"] if datasheet else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("side", "batching") else "right")
    for name, s in summary.items():
        if "skipped" in s:
            table.add_row(name, "skipped")
            continue
        row = [
            name,
            s["batching"],
            f"{s['tokens']:,}",
            f"{s['seconds']:.1f}",
            f"{s['cpu_s']:.1f}",
            f"{s['tokens_per_s']:,.0f}",
            f"{ours['tokens_per_s'] / s['tokens_per_s']:.2f}",
            f"{s['loss']:.4f}",
            f"{s['peak_memory_mb']:,.0f}",
            f"{s['share_head_all_pct']:.1f}",
            f"{s['share_pct']:.1f}",
        ]
        table.add_row(*row, *([f"{s['mfu_datasheet_pct']:.1f}"] if datasheet else []))
    console.print(table)
    for name, s in summary.items():
        if "skipped" in s:
            console.print(f"{name} skipped: {s['skipped']}")
    for name in ("trainer", "bare_padded", "bare_packed"):
        if name in summary and "skipped" not in summary[name]:
            diff = abs(summary[name]["loss"] - ours["loss"])
            tol = 1e-4 if setup.precision == "fp32" else 2e-2 * abs(ours["loss"])
            verdict = "matches" if diff < tol else "DIFFERS"
            console.print(
                f"loss: tunelab {ours['loss']:.6f} vs {name} {summary[name]['loss']:.6f} "
                f"(same batches): {verdict} (|diff| {diff:.2e}, tolerance {tol:.1e})"
            )
    unit = "GFLOP/s"
    console.print(
        f"matmul peak {peak:.1f} {unit} (before {peaks[0]:.1f}, after {peaks[1]:.1f})"
        + (f"; datasheet {datasheet} TFLOP/s bf16 dense" if datasheet else "")
        + f"; load average {load_before:.2f} before, {load_average():.2f} after"
    )
    if args.json:
        print(json.dumps({"facts": facts, "peak_gflops": peaks, "sides": summary}))
    print_last_lines(setup, summary, ours)


def print_last_lines(setup: Setup, summary: dict, ours: dict) -> None:
    def ratio(*names: str) -> str:
        rates = [summary[n]["tokens_per_s"] for n in names if "tokens_per_s" in summary.get(n, {})]
        return f"{ours['tokens_per_s'] / max(rates):.2f}" if rates else "na"

    bare = summary.get("bare_packed", {})
    overhead = (
        f"{(bare['tokens_per_s'] / ours['tokens_per_s'] - 1) * 100:.1f}"
        if "tokens_per_s" in bare
        else "na"
    )
    print(f"peak_share_loss_only_pct={ours['share_pct']:.1f}")
    line = (
        f"ratio_vs_trainer={ratio('trainer')} "
        f"ratio_vs_trl_packing={ratio('trl_packing', 'trl_packing_b1')} "
        f"overhead_vs_bare_pct={overhead} peak_share_pct={ours['share_head_all_pct']:.1f}"
    )
    if setup.device == "cuda":
        mfu = ours["mfu_datasheet_pct"]
        line += (
            f" ratio_vs_trainer_liger={ratio('trainer_liger')} "
            f"ratio_vs_trl_padding_free={ratio('trl_padding_free')} "
            f"mfu_datasheet_pct={f'{mfu:.1f}' if mfu is not None else 'na'}"
        )
    print(line)


if __name__ == "__main__":
    main()
