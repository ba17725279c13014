"""Training throughput: tunelab's loop against Trainer + peft, TRL SFTTrainer and a bare loop.

    python benchmarks/throughput.py            # every side once, each in its own process
    python benchmarks/throughput.py --rounds 3 # three alternating rounds, best per side
    python benchmarks/throughput.py --max-load 1.5  # on a shared machine: wait for quiet

The workload is built once and read by every side: a Llama from a local LlamaConfig (hidden 256,
4 layers, 4 heads, intermediate 688, vocab 8192, random weights), 2,000 synthetic prompt /
completion pairs with long-tailed lengths (25 to 509 tokens, median about 95; loss on the
completion only), LoRA r=8 alpha 16 on q,k,v,o, micro-batch 4 x accumulation 2, 30 optimizer
steps, AdamW lr 1e-3 with linear decay, grad clip 1.0, fp32, 2 threads.

Sides (each a fresh Python process, run in turn, the order rotating between rounds):
- tunelab: `tunelab.train.loop.train_loop` over `StepSource` (packed, the default), the model
  adapted by `tunelab.models.adapt`.
- trainer: transformers Trainer + peft, dynamic padding per micro-batch, the same examples in the
  same order as tunelab (a sequential sampler over tunelab's data order).
- trl_packing: TRL SFTTrainer, `packing=True` (bfd, padding-free), `max_length=512`,
  completion-only loss; its own packing and order, so its loss is not comparable. A micro-batch
  is 4 packed rows of up to 512 tokens, which TRL flattens into one row of about 2,000 tokens.
- trl_packing_b1: the same with 1 packed row per micro-batch (about 500 tokens, the size of
  tunelab's micro-batch of 4 examples). `ratio_vs_trl_packing` is against the faster of the two.
- bare_packed: a plain PyTorch loop over the same packed micro-batches as tunelab doing the same
  arithmetic written inline (per-example attention, body -> hidden states at loss positions ->
  head, cross-entropy): what is left between the two is tunelab's machinery (data order,
  collation, token counting, clipping, checks, the route and packing checks).
- bare_padded: a plain PyTorch loop over the trainer's padded batches, full logits.
Optional (`--sides`): trl_padding_free, trl_padded, bare_packed_blockmask (packed with
transformers' block-diagonal mask instead of per-example attention), bare_packed_full (block
mask and full logits).

Reported per side: non-padding tokens per second over the 30 steps (from the start of the first
to the end of the last; with `--rounds N`, the best round, the least disturbed by other work on
the machine), the process CPU seconds over the same steps, the final step's loss, peak RSS of the process, and useful model FLOP/s
as a share of this machine's fp32 matmul peak (measured here, 2 threads, before and after the
sides). Useful FLOPs are the matmul FLOPs of non-padding tokens (padding does no useful
work): decoder linear layers forward and input-gradient backward (the base is frozen), LoRA
forward and backward, causal attention within each example, and the LM head at every
non-padding token (`% peak`, the share in the last line). `% peak loss-only` counts the head at
the loss positions only, the least the loss needs, which does not credit tunelab for the head
work it skips.

The last line reads `ratio_vs_trainer=X ratio_vs_trl_packing=Y overhead_vs_bare_pct=Z
peak_share_pct=P`; the line before it gives the loss-only share.
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
from pathlib import Path

HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 256, 4, 4, 688, 8192
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA = 8, 16
MICRO, ACCUM, LR, MAX_LEN = 4, 2, 1e-3, 512
DEFAULT_SIDES = [
    "tunelab",
    "trainer",
    "trl_packing",
    "trl_packing_b1",
    "bare_packed",
    "bare_padded",
]
ALL_SIDES = DEFAULT_SIDES + [
    "trl_padding_free",
    "trl_padded",
    "bare_packed_blockmask",
    "bare_packed_full",
]
SEED = 0


# ------------------------------------------------------------------ workload (parent)


def build_workload(root: Path, num_examples: int, steps: int) -> dict:
    """Save the model and the examples under `root`; returns the workload description."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunelab.train.batches import DataOrder, Position

    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    save_tokenizer(root / "model")

    rng = np.random.default_rng(SEED)
    lengths = np.clip(np.rint(rng.lognormal(math.log(95), 0.8, num_examples)), 25, 509)
    ranks = np.arange(3, VOCAB)
    weights = 1.0 / (ranks - 2 + 10.0) ** 1.1  # Zipf-like: frequent tokens are learnable
    weights /= weights.sum()
    examples = []
    for length in lengths.astype(int).tolist():
        completion = max(2, round(length * rng.uniform(0.2, 0.5)))
        body = rng.choice(ranks, size=length - 2, p=weights).tolist()
        ids = [1, *body, 2]  # BOS ... EOS (the EOS is part of the completion)
        prompt = length - completion
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    order, _ = DataOrder(num_examples, SEED).take(Position(), steps * MICRO * ACCUM)
    workload = {"examples": examples, "order": order, "steps": steps}
    (root / "workload.json").write_text(json.dumps(workload))
    used = [examples[i] for i in order]
    padded = sum(
        max(len(e["input_ids"]) for e in used[k : k + MICRO]) * len(used[k : k + MICRO])
        for k in range(0, len(used), MICRO)
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


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the ids (TRL wants one for its pad and EOS ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    tok.save_pretrained(path)


def measure_matmul_peak(threads: int, seconds: float = 3.0) -> float:
    """Best fp32 GFLOP/s of large square matmuls with `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for n in (1024, 2048, 3072):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm up
        deadline = time.perf_counter() + seconds / 3
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def useful_flops(examples: list[list[int]], head_all: bool = False) -> float:
    """Matmul FLOPs a LoRA step needs on examples given as [length, loss positions] (see doc)."""
    linear = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
    lora = LAYERS * len(TARGETS) * RANK * (HIDDEN + HIDDEN)
    total = 0.0
    for length, loss in examples:
        total += 4 * linear * length  # forward + input gradients
        total += 6 * lora * length  # forward + input and weight gradients
        total += 3 * LAYERS * 2 * HIDDEN * length * (length + 1)  # causal QK^T and AV, fwd + bwd
        total += 4 * HIDDEN * VOCAB * (length if head_all else loss)
    return total


# ------------------------------------------------------------------ sides (child processes)


def load_workload(root: Path) -> dict:
    return json.loads((root / "workload.json").read_text())


def load_model(root: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=torch.float32, attn_implementation="sdpa"
    )


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
    labels = batch["labels"]
    out = []
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        for row in range(labels.shape[0]):
            n = int(batch["attention_mask"][row].sum())
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


def side_tunelab(root: Path, w: dict) -> dict:
    import torch

    from tunelab.config import AdaptationConfig, TrainingConfig
    from tunelab.models import adapt
    from tunelab.train.batches import DataOrder, StepSource
    from tunelab.train.loop import Loop, TrainState, build_optimizer, build_scheduler, train_loop

    steps = w["steps"]
    cfg = TrainingConfig(
        seed=SEED,
        micro_batch_size=MICRO,
        grad_accum_steps=ACCUM,
        max_steps=steps,
        lr=LR,
        schedule="linear",
        grad_clip=1.0,
        precision="fp32",
    )
    assert cfg.packing, "packing is the default"
    torch.manual_seed(SEED)
    model, _ = adapt(
        load_model(root),
        AdaptationConfig(method="lora", target_modules=TARGETS, rank=RANK, alpha=ALPHA),
        "causal_lm",
    )
    source = StepSource(
        w["examples"], DataOrder(len(w["examples"]), cfg.seed), MICRO, ACCUM, 0, "causal_lm", True
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)
    loop = Loop(
        model, optimizer, build_scheduler(optimizer, cfg, steps), source, cfg, steps, "causal_lm"
    )
    rows: list[dict] = []
    started, cpu = time.perf_counter(), time.process_time()
    train_loop(loop, TrainState(), [lambda state, row: rows.append(row)])
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    seen = [w["examples"][i] for i in w["order"]]
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "tokens": sum(r["tokens"] for r in rows),
        "loss": rows[-1]["loss"],
        "examples_seen": [[len(e["input_ids"]), _loss_positions(e)] for e in seen],
        "batching": "packed",
    }


def _loss_positions(e: dict) -> int:
    return sum(1 for x in e["labels"][1:] if x != -100)


def bare_loop(
    root: Path, w: dict, batches: list[list[dict]], loss_fn, per_example_attention: bool = False
) -> dict:
    """A plain loop: AdamW, linear decay, clip 1.0, loss summed then divided by the step's
    loss tokens."""
    import torch

    from tunelab.train.attention import use_packed_sdpa

    model = peft_lora(load_model(root))
    if per_example_attention:
        assert use_packed_sdpa(model.get_base_model())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    steps = len(batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / steps))
    model.train()
    tokens, seen, loss = 0, [], float("nan")
    started, cpu = time.perf_counter(), time.process_time()
    for micro_batches in batches:
        loss_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        total = 0.0
        for b in micro_batches:
            ce = loss_fn(model, b)
            (ce / loss_tokens).backward()
            total += ce.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss = total / loss_tokens
        for b in micro_batches:
            seg = segments(b)
            seen += seg
            tokens += sum(n for n, _ in seg)
    return {
        "seconds": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,
        "tokens": tokens,
        "loss": loss,
        "examples_seen": seen,
    }


def steps_of(w: dict, collate) -> list[list[dict]]:
    used = [w["examples"][i] for i in w["order"]]
    per_step = MICRO * ACCUM
    return [
        [collate(used[k + m : k + m + MICRO]) for m in range(0, per_step, MICRO)]
        for k in range(0, len(used), per_step)
    ]


def side_bare_packed(root: Path, w: dict, per_example_attention: bool = True) -> dict:
    """The loss written inline: body -> hidden states at loss positions -> head."""
    import torch.nn.functional as F

    from tunelab.train.attention import segment_bounds

    def loss_fn(model, b):
        inner = model.get_base_model()
        extra = {"tunelab_segments": segment_bounds(b["position_ids"])}
        hidden = inner.model(
            input_ids=b["input_ids"],
            position_ids=b["position_ids"],
            use_cache=False,
            **(extra if per_example_attention else {}),
        ).last_hidden_state
        labels = b["labels"][:, 1:]
        keep = labels != -100
        logits = inner.lm_head(hidden[:, :-1][keep])  # [loss tokens, vocab]
        return F.cross_entropy(logits, labels[keep], reduction="sum")

    batches = steps_of(w, pack_batch)
    return {**bare_loop(root, w, batches, loss_fn, per_example_attention), "batching": "packed"}


def side_bare_packed_full(root: Path, w: dict) -> dict:
    import torch.nn.functional as F

    def loss_fn(model, b):
        logits = model(
            input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False
        ).logits
        labels = b["labels"][:, 1:]
        keep = labels != -100
        return F.cross_entropy(logits[:, :-1][keep], labels[keep], reduction="sum")

    return {**bare_loop(root, w, steps_of(w, pack_batch), loss_fn), "batching": "packed"}


def side_bare_padded(root: Path, w: dict) -> dict:
    import torch.nn.functional as F

    def loss_fn(model, b):
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False
        ).logits
        labels = b["labels"][:, 1:]
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )

    return {**bare_loop(root, w, steps_of(w, pad_batch), loss_fn), "batching": "padded"}


class StepClock:
    """Trainer callback: time from the first step's start to the last step's end, and the loss
    of each step (summed over its micro-batches by the trainer subclasses below)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if clock.started is None:
                    clock.started, clock.cpu_started = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kw):
                clock.ended, clock.cpu_ended = time.perf_counter(), time.process_time()
                clock.losses.append(clock.step_loss)
                clock.step_loss = 0.0

        self.callback = _Callback()
        self.started: float | None = None
        self.ended: float | None = None
        self.cpu_started = self.cpu_ended = 0.0
        self.losses: list[float] = []
        self.step_loss = 0.0
        self.tokens = 0
        self.seen: list[list[int]] = []

    def count(self, inputs: dict, loss) -> None:
        b = {k: v for k, v in inputs.items() if k in ("labels", "attention_mask", "position_ids")}
        if "attention_mask" not in b and "position_ids" not in b:
            raise RuntimeError(f"no example boundaries in a batch with keys {sorted(inputs)}")
        seg = segments(b)
        self.seen += seg
        self.tokens += sum(n for n, _ in seg)
        self.step_loss += float(loss.detach())

    def result(self) -> dict:
        assert self.started is not None and self.ended is not None
        return {
            "seconds": self.ended - self.started,
            "cpu_s": self.cpu_ended - self.cpu_started,
            "tokens": self.tokens,
            "loss": self.losses[-1],
            "examples_seen": self.seen,
        }


def counting(trainer_cls, clock: StepClock):
    class Counting(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen = {
                k: inputs[k] for k in ("labels", "attention_mask", "position_ids") if k in inputs
            }
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            clock.count(seen, loss[0] if isinstance(loss, tuple) else loss)
            return loss

    return Counting


def side_trainer(root: Path, w: dict) -> dict:
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    model = peft_lora(load_model(root))
    ordered = [w["examples"][i] for i in w["order"]]
    clock = StepClock()

    class SameOrder(counting(Trainer, clock)):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUM,
            max_steps=w["steps"],
            learning_rate=LR,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=SEED,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = SameOrder(
            model=model,
            args=args,
            train_dataset=ordered,
            data_collator=pad_batch,
            callbacks=[clock.callback],
        )
        trainer.train()
    return {**clock.result(), "batching": "padded"}


def side_trl(root: Path, w: dict, mode: str, micro: int = MICRO) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model = peft_lora(load_model(root))
    data = Dataset.from_dict(
        {
            "input_ids": [e["input_ids"] for e in w["examples"]],
            "completion_mask": [[int(x != -100) for x in e["labels"]] for e in w["examples"]],
        }
    )
    clock = StepClock()
    options = {
        "packing": {"packing": True, "packing_strategy": "bfd", "max_length": MAX_LEN},
        "padding_free": {"padding_free": True, "max_length": None},
        "padded": {"max_length": MAX_LEN},
    }[mode]
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=ACCUM,
            max_steps=w["steps"],
            learning_rate=LR,
            lr_scheduler_type="linear",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            completion_only_loss=True,
            seed=SEED,
            disable_tqdm=True,
            dataloader_num_workers=0,
            **options,
        )
        trainer = counting(SFTTrainer, clock)(
            model=model, args=args, train_dataset=data, callbacks=[clock.callback]
        )
        trainer.train()
    return {**clock.result(), "batching": mode.replace("_", "-")}


SIDES = {
    "tunelab": side_tunelab,
    "trainer": side_trainer,
    "trl_packing": lambda r, w: side_trl(r, w, "packing"),
    "trl_packing_b1": lambda r, w: side_trl(r, w, "packing", micro=1),
    "trl_padding_free": lambda r, w: side_trl(r, w, "padding_free"),
    "trl_padded": lambda r, w: side_trl(r, w, "padded"),
    "bare_packed": side_bare_packed,
    "bare_packed_blockmask": lambda r, w: side_bare_packed(r, w, per_example_attention=False),
    "bare_packed_full": side_bare_packed_full,
    "bare_padded": side_bare_padded,
}


def run_side(name: str, root: Path, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    result = SIDES[name](root, load_workload(root))
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(result))


# ------------------------------------------------------------------ report (parent)


def spawn(name: str, root: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONWARNINGS", "ignore")
    cmd = [
        sys.executable,
        __file__,
        "--side",
        name,
        "--workdir",
        str(root),
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"side {name} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=",".join(ALL_SIDES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
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
    args = parser.parse_args()
    if args.side:
        run_side(args.side, Path(args.workdir), args.threads)
        return

    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown or "tunelab" not in sides:
        raise SystemExit(f"--sides: unknown {unknown} or no tunelab; choose from {ALL_SIDES}")
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    with tempfile.TemporaryDirectory(prefix="tunelab-throughput-") as tmp:
        root = Path(tmp)
        facts = build_workload(root, args.examples, args.steps)
        load_before = load_average()
        peaks = [measure_matmul_peak(args.threads)]
        console.print(
            f"workload: {facts['examples']} examples, lengths {facts['length_min']}-"
            f"{facts['length_max']} (median {facts['length_median']:.0f}), "
            f"{facts['loss_share']:.0%} of tokens carry loss; {args.steps} steps hold "
            f"{facts['tokens_in_steps']:,} tokens ({facts['padded_tokens_in_steps']:,} padded); "
            f"matmul peak {peaks[0]:.1f} GFLOP/s ({args.threads} threads); load {load_before:.2f}"
        )
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for name in order:
                waited = wait_for_load(args.max_load, args.max_wait)
                load_at_start = load_average()
                res = spawn(name, root, args.threads)
                res["load_at_start"], res["waited_s"] = load_at_start, waited
                runs[name].append(res)
                console.print(
                    f"  round {r + 1} {name:<17} {res['tokens'] / res['seconds']:8.0f} tok/s  "
                    f"loss {res['loss']:.4f}  (load {load_at_start:.2f} -> {load_average():.2f}"
                    + (f", waited {waited:.0f} s" if waited else "")
                    + ")"
                )
        peaks.append(measure_matmul_peak(args.threads))
    peak = max(peaks)

    summary: dict[str, dict] = {}
    for name, results in runs.items():
        rates = [x["tokens"] / x["seconds"] for x in results]
        best = results[rates.index(max(rates))]  # the least disturbed round
        seconds = best["seconds"]
        summary[name] = {
            "batching": best["batching"],
            "tokens": best["tokens"],
            "seconds": seconds,
            "tokens_per_s": best["tokens"] / seconds,
            "cpu_s": best["cpu_s"],
            "all_tokens_per_s": rates,
            "loss": best["loss"],
            "peak_rss_mb": max(x["peak_rss_mb"] for x in results),
            "share_pct": 100 * useful_flops(best["examples_seen"]) / seconds / 1e9 / peak,
            "share_head_all_pct": 100
            * useful_flops(best["examples_seen"], head_all=True)
            / seconds
            / 1e9
            / peak,
        }
    ours = summary["tunelab"]

    table = Table(title=f"throughput ({args.steps} steps, fp32, {args.threads} threads)")
    for col in ("side", "batching", "tokens", "s", "CPU s", "tok/s", "tunelab x", "final loss"):
        table.add_column(col, justify="left" if col in ("side", "batching") else "right")
    for col in ("peak RSS MB", "% peak", "% peak loss-only"):
        table.add_column(col, justify="right")
    for name, s in summary.items():
        table.add_row(
            name,
            s["batching"],
            f"{s['tokens']:,}",
            f"{s['seconds']:.1f}",
            f"{s['cpu_s']:.1f}",
            f"{s['tokens_per_s']:,.0f}",
            f"{ours['tokens_per_s'] / s['tokens_per_s']:.2f}",
            f"{s['loss']:.4f}",
            f"{s['peak_rss_mb']:,.0f}",
            f"{s['share_head_all_pct']:.1f}",
            f"{s['share_pct']:.1f}",
        )
    console.print(table)
    same_batches = [n for n in ("trainer", "bare_padded", "bare_packed") if n in summary]
    for name in same_batches:
        diff = abs(summary[name]["loss"] - ours["loss"])
        verdict = "matches" if diff < 1e-4 else "DIFFERS"
        console.print(
            f"loss: tunelab {ours['loss']:.6f} vs {name} {summary[name]['loss']:.6f} "
            f"(same batches): {verdict} (|diff| {diff:.2e})"
        )
    console.print(
        f"matmul peak {peak:.1f} GFLOP/s (before {peaks[0]:.1f}, after {peaks[1]:.1f}); "
        f"load average {load_before:.2f} before, {load_average():.2f} after"
    )
    if args.json:
        print(json.dumps({"facts": facts, "peak_gflops": peaks, "sides": summary}))

    def ratio(*names: str) -> str:
        rates = [summary[n]["tokens_per_s"] for n in names if n in summary]
        return f"{ours['tokens_per_s'] / max(rates):.2f}" if rates else "na"

    overhead = (
        f"{(summary['bare_packed']['tokens_per_s'] / ours['tokens_per_s'] - 1) * 100:.1f}"
        if "bare_packed" in summary
        else "na"
    )
    print(f"peak_share_loss_only_pct={ours['share_pct']:.1f}")
    print(
        f"ratio_vs_trainer={ratio('trainer')} "
        f"ratio_vs_trl_packing={ratio('trl_packing', 'trl_packing_b1')} "
        f"overhead_vs_bare_pct={overhead} peak_share_pct={ours['share_head_all_pct']:.1f}"
    )


if __name__ == "__main__":
    main()
