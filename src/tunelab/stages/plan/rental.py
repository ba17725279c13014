"""The inputs of a plan for a catalog GPU: the study's shape read from its records (or its
config.json alone), and the figures of `build_plan` projected onto the rental.

What runs on the GPU is projected (`project`): training steps, validation forwards, evaluation.
What the GPU does not speed up (loading files, importing, writing checkpoints, hashing the base)
is taken as measured on this machine when a record has it, else assumed from the bytes at a
disk's speed; each figure says which.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.config_sections import CLASSIFYING_KINDS
from tunelab.core.errors import SnapshotError
from tunelab.core.evidence import latest
from tunelab.core.record_sizing import lengths_of
from tunelab.core.record_types import RunConfig, Sizing
from tunelab.core.run_parts import RunEnv
from tunelab.core.study import Study
from tunelab.stages.plan.estimate import PROCESS_START_S
from tunelab.stages.plan.figures import (
    Figure,
    Figures,
    Lengths,
    baseline_record,
    decoding_batches,
    facts_of,
    gather_figures,
    split_counts,
)
from tunelab.stages.plan.project import Projection, StudyShape
from tunelab.stages.plan.shapes import facts_from_config, read_model_config
from tunelab.stages.sizing.terms import ModelFacts

DISK_BYTES_PER_S = 1e9  # reading or writing model files on the rental (assumed)
TOKENIZE_S_PER_EXAMPLE = 1e-3  # tokenizing one example (assumed, without a sizing record)
SIZING_STEPS = 6  # steps `tunelab size` runs per configuration (warm-up, timed, memory)
CHARS_PER_TOKEN = 4  # English text in a BPE vocabulary, without a tokenizer at hand (assumed)
TEMPLATE_TOKENS = 16  # a chat template's and an instruction's tokens around the text (assumed)


def _architecture(config: dict[str, Any], declared: str) -> str:
    if declared != "auto":
        return declared
    names = " ".join(config.get("architectures") or [])
    return (
        "causal_lm"
        if "CausalLM" in names or config.get("model_type") in ("llama", "qwen2", "mistral")
        else "encoder"
    )


def _labels(study: Study) -> list[str]:
    from tunelab.stages.data import load_snapshot

    try:
        return list(load_snapshot(study).labels or [])
    except SnapshotError:
        return list(study.config.task.labels or [])


def _facts(study: Study, sizing: Sizing | None, labels: list[str]) -> tuple[ModelFacts, str]:
    if sizing is not None and facts_of(sizing).layer_training is not None:
        return ModelFacts.from_dict(sizing.facts or {}), f"sizing {sizing.id}: the adapted model"
    return config_facts(study.config, study.root, len(labels))


def config_facts(cfg: StudyConfig, root: Path, num_labels: int = 0) -> tuple[ModelFacts, str]:
    """The adapted model's facts from the base's config.json alone (no weights read), and
    where they came from. Raises StudyError when the base has no config.json."""
    from tunelab.lib.models.loading import base_folder

    folder = base_folder(cfg.model, root)  # a hub base: its snapshot in the hub cache
    config = read_model_config(folder)
    facts = facts_from_config(
        config,
        cfg.adaptation,
        architecture=_architecture(config, cfg.model.architecture),
        dtype=cfg.model.dtype,
        num_labels=num_labels,
    )
    return (
        facts,
        f"{folder / 'config.json'} with adaptation {cfg.adaptation.method} (no weights read)",
    )


def layout_load_problem(
    cfg: StudyConfig,
    root: Path,
    *,
    strategy: str,
    nproc: int,
    nnodes: int = 1,
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    evaluation: bool = True,
) -> str | None:
    """Why `tunelab train --nproc N --strategy S` cannot load the study's base on GPUs of
    `device_bytes` (nodes of `host_bytes`), or None when it can (see tunelab.stages.sizing.load).
    With `evaluation`, a layout that loads is still refused when the study's evaluation cannot
    fit one of those GPUs (`tunelab eval` loads the whole model on one device), at the longest
    sequence preprocess.max_seq_len allows (a generated answer's room cut from the prompt; no
    tokenizer is read). The facts come from the
    base's config.json; the precision is the rental's (bf16 unless training.precision says
    fp16)."""
    from tunelab.stages.sizing.load import load_peak, load_problem, strategy_refusal
    from tunelab.stages.sizing.peaks import evaluation_kind, plan_peak

    facts, _ = config_facts(cfg, root, len(cfg.task.labels or []))
    ranks = max(1, nproc) * max(1, nnodes)
    refusal = strategy_refusal(facts, strategy, cfg.training.precision)
    peak = load_peak(facts, strategy, ranks, max(1, nproc), "cuda")
    problem = refusal or load_problem(peak, device_bytes, host_bytes)
    if problem is not None or device_bytes is None or not evaluation:
        return problem
    precision = "fp16" if cfg.training.precision == "fp16" else "bf16"
    tokens = cfg.preprocess.max_seq_len  # a generated answer's room is cut from the prompt
    if evaluation_kind(cfg, facts.architecture) == "generation":
        tokens = max(1, tokens - cfg.evaluation.max_new_tokens)
    return plan_peak(0, facts, cfg, tokens, precision, device_bytes, gpus=ranks)[1]


def character_lengths(
    study: Study, max_seq_len: int
) -> tuple[tuple[float, ...], float, int, float]:
    """(length quantiles, mean, longest, loss share) of the training split from its characters,
    without a tokenizer: the prompt and the answer at CHARS_PER_TOKEN each, plus the template."""
    from tunelab.stages.data import load_snapshot

    try:
        rows = load_snapshot(study).rows("train")
    except SnapshotError:
        rows = []
    if not rows:
        return (), float(max_seq_len), max_seq_len, 1.0
    sizes, answers = [], 0.0
    for r in rows:
        answer = len(str(r.get("target") or r.get("label") or "")) / CHARS_PER_TOKEN + 1
        prompt = len(str(r.get("text") or "")) / CHARS_PER_TOKEN + TEMPLATE_TOKENS
        total = min(max_seq_len, prompt + answer)
        sizes.append(total)
        answers += min(answer, total)
    sizes.sort()
    quantiles = tuple(sizes[round(i * (len(sizes) - 1) / 100)] for i in range(101))
    return quantiles, sum(sizes) / len(sizes), math.ceil(sizes[-1]), answers / sum(sizes)


def gather_shape(study: Study) -> tuple[StudyShape, Sizing | None]:
    """The study's shape for a projection, and its latest sizing record (None without one)."""
    cfg = study.config
    found = latest(study, "sizing")
    sizing = Sizing.read(found.path) if found else None
    lengths = lengths_of(sizing) if sizing is not None else None
    labels = _labels(study)
    facts, facts_source = _facts(study, sizing, labels)
    causal = facts.architecture == "causal_lm"
    quantiles = tuple((lengths and lengths.quantiles) or ())
    if sizing is not None and lengths is not None and quantiles:
        mean, longest = float(lengths.mean or 0.0), int(lengths.max or 0)
        fed = "fed its image chain" if facts.architecture == "image" else "tokenized"
        lengths_source = f"sizing {sizing.id}: the training split {fed}"
        if causal and lengths.loss_fraction is not None:
            loss, loss_source = float(lengths.loss_fraction), lengths_source
        else:
            loss, loss_source = (1.0, "assumed: every position") if causal else (0.0, "the label")
    else:
        quantiles, mean, longest, loss = character_lengths(study, cfg.preprocess.max_seq_len)
        lengths_source = loss_source = (
            f"assumed: {CHARS_PER_TOKEN} characters a token of the snapshot's training texts, "
            "at most max_seq_len (no sizing record: `tunelab size` tokenizes them)"
        )
        if not causal:
            loss, loss_source = 0.0, "the label"
    generating = causal and cfg.task.kind not in CLASSIFYING_KINDS
    ev = cfg.evaluation
    prompt, answers, gen_source = _generation(
        study, mean, longest, loss, ev.max_new_tokens, generating
    )
    requested = cfg.training.precision
    precision = requested if requested in ("bf16", "fp16") else "bf16"
    planned_as = (
        "training.precision auto: bf16 autocast on a GPU that has it"
        if requested == "auto"
        else "training.precision is fp32: planned in bf16 autocast on the GPU "
        "(set training.precision=bf16 there)"
    )
    shape = StudyShape(
        facts=facts,
        facts_source=facts_source,
        quantiles=quantiles,
        mean_len=mean,
        max_len=longest,
        lengths_source=lengths_source,
        loss_fraction=loss,
        loss_source=loss_source,
        packing=bool(cfg.training.packing and causal),
        counts=split_counts(study, (lengths and lengths.split_counts) or {}),
        generating=generating,
        candidates=len(labels) if causal and not generating and labels else 1,
        eval_batch=ev.batch_size,
        prompt_len=prompt,
        answer_steps=answers,
        generation_source=gen_source,
        precision=precision,
        precision_source="training.precision" if precision == requested else planned_as,
    )
    return shape, sizing


def _generation(
    study: Study, mean: float, longest: int, loss: float, max_new_tokens: int, generating: bool
) -> tuple[float, float, str]:
    """(prompt tokens, decoding steps of a batch, source): the baseline's batches when it ran;
    a task that does not generate scores an example in its forwards, with no decoding."""
    if not generating:
        steps = min(max_new_tokens, math.ceil(longest * loss))
        return mean * (1 - loss), steps, "given by the task: it scores each example, no decoding"
    row, rec = baseline_record(study)
    batches = decoding_batches(rec) if rec is not None else []
    if row is not None and batches:  # each batch as `tunelab eval` wrote it
        prompt = sum(b.prompt_tokens or 0.0 for b in batches) / len(batches)
        steps = sum(b.answer_steps for b in batches) / len(batches)
        return prompt, steps, f"baseline {row.id}: its prompts, and the answers' length a batch"
    prompt = mean * (1 - loss)
    steps = min(max_new_tokens, math.ceil(longest * loss))
    return prompt, steps, "assumed from the training lengths (no baseline record)"


def local_figures(study: Study) -> Figures | None:
    """The figures measured on this machine, or None without a sizing record."""
    return gather_figures(study) if latest(study, "sizing") is not None else None


def _here(fig: Figure | None, fallback: float, assumed: str) -> Figure:
    if fig is not None and fig.value is not None:
        return Figure(fig.value, f"{fig.source}; measured here, the same on the rental")
    return Figure(fallback, f"assumed: {assumed}")


def projected_figures(
    local: Figures | None,
    shape: StudyShape,
    proj: Projection,
    cfg: StudyConfig,
    configurations: int,
) -> Figures:
    """`build_plan`'s figures for the rental (see the module docstring)."""
    f, step = shape.facts, proj.step
    on = f"{proj.gpus}x {proj.gpu}"
    u = proj.utilization
    weights = f.total_weight_bytes
    load = _here(
        local and local.load_s,
        PROCESS_START_S + weights / DISK_BYTES_PER_S,
        f"a process start and {weights / 1e9:.2f} GB of weights read",
    )
    save_bytes = 3 * f.trainable_bytes  # the trained weights and two optimizer states
    save = _here(
        local and local.checkpoint_save_s,
        save_bytes / DISK_BYTES_PER_S,
        f"{save_bytes / 1e9:.2f} GB written",
    )
    step_source = (
        f"projected on {on}: {step.flops / 1e12:.3g} TFLOP a step at {u.value:.0%} of the peak "
        f"({u.source}), micro-batch {proj.fit.micro_batch} x {proj.fit.grad_accum}"
        + (", bound by the host" if step.bound == "host" else "")
        + f"; {step.low:.3g}-{step.high:.3g} s over the utilization's range"
    )
    sizing_s = configurations * (PROCESS_START_S + load.seconds + SIZING_STEPS * step.value)
    return Figures(
        device="cuda",
        sizing_id=local.sizing_id if local else None,
        step_s=Figure(step.value, step_source),
        forward_s=Figure(proj.forward_s, f"projected on {on}: a validation forward"),
        load_s=load,
        encode_s=_here(
            local and local.encode_s,
            shape.counts.train * TOKENIZE_S_PER_EXAMPLE,
            f"{TOKENIZE_S_PER_EXAMPLE * 1000:g} ms an example",
        ),
        sizing_s=Figure(
            sizing_s,
            f"projected: {configurations} configurations, each a process, a "
            f"load and {SIZING_STEPS} steps",
        ),
        tokens_per_s=Figure(step.tokens / step.value, f"projected on {on}"),
        counts=shape.counts,
        lengths=local.lengths if local else Lengths(mean=shape.mean_len, max=shape.max_len),
        eval_s_per_example=Figure(
            proj.eval_s_per_example,
            f"projected on {on}: "
            + ("prefill and decoding steps" if shape.generating else "forward passes")
            + " at the answers' length" * shape.generating,
        ),
        checkpoint_save_s=save,
        reload_s=_here(local and local.reload_s, load.seconds, "as the model's load"),
        smoke_s=Figure(None, "projected from its parts: a start, 4 steps and an evaluation"),
        process_start_s=_here(local and local.process_start_s, PROCESS_START_S, "a process start"),
        baseline_s=Figure(None, "projected from its parts: a load and the evaluation"),
        base_hash_s=_here(
            local and local.base_hash_s,
            weights / DISK_BYTES_PER_S,
            f"{weights / 1e9:.2f} GB hashed",
        ),
        method=cfg.adaptation.method,
        eval_max_examples=cfg.evaluation.max_examples,
    )


def sizing_configurations(sizing: Sizing | None) -> int:
    """How many configurations `tunelab size` measures for the study (4 without a record)."""
    return (len(sizing.rows) if sizing is not None else 0) or 4


def measured_run_utilization(study: Study, shape: StudyShape) -> tuple[float, Any, str] | None:
    """The newest completed training run of the study on a catalog GPU, as a share of that
    GPU's peak: (share, GPU, where it came from), or None when no run trained on CUDA."""
    from tunelab.stages.plan.catalog import gpu_of_device
    from tunelab.stages.plan.flops import micro_step_flops
    from tunelab.stages.plan.project import micro_batch
    from tunelab.stages.plan.review import mean_step_s

    for row in reversed([r for r in study.ledger.list_runs("train") if r.status == "completed"]):
        folder = study.runs_dir / row.id
        if not (folder / "env.json").exists() or not (folder / "config.json").exists():
            continue
        env = RunEnv.read(folder / "env.json")
        names = [g.name for g in env.devices]
        gpu = gpu_of_device(names[0]) if names else None
        step = mean_step_s(study, row.id)
        if gpu is None or not step or not str(env.compute_device or "").startswith("cuda"):
            continue
        t = RunConfig.read(folder / "config.json").training  # the study config's section
        flops = (
            micro_step_flops(
                shape.facts,
                micro_batch(shape, t.micro_batch_size),
                checkpointing=bool(t.activation_checkpointing),
            ).total
            * t.grad_accum_steps
        )
        precision = t.precision if t.precision in ("bf16", "fp16") else "fp32"
        share = flops / (step * gpu.peak_flops(precision))
        return share, gpu, f"train run {row.id} on {names[0]}: {step:.3f} s a step"
    return None
