"""The steps that really peak: the worst batch a run meets, and its evaluation.

A typical step at the data's p95 and longest length is not the whole story of a run: the
longest packed batch comes at one step of the seeded order, and the evaluation after training
(`tunelab eval`) holds a KV cache of `evaluation.batch_size` rows of the longest prompt plus
`max_new_tokens`, or runs a classifier's forward at its own batch size.

- `find_worst_batch(lengths, training, architecture, steps)`: the micro-batch of the run with
  the most tokens (packed: the row's total; padded: rows x the longest), found by walking the
  trainer's own order (`stages.train.batches.StepSource.step_pairs` over `DataOrder`, the seed
  of `training.seed`) over every step of the run; `worst_case(template, worst)` its `Case`.
- `evaluation_settings(cfg, architecture, tokens)` and `evaluation_increase(facts, settings,
  precision)`: what evaluation adds to a process holding the model (pure arithmetic, the
  analytic side of `evaluation_peak`; the measured side is `measure_peaks.measure_evaluation`).
- `peak_total(peak)`: the whole-process (CPU RSS) or allocated (CUDA) bytes of a recorded peak,
  measured where it was, else predicted; `planning_peak_bytes(record)`: the larger of the
  training and evaluation peaks, which a plan must provision.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tunelab.core.errors import TunelabError
from tunelab.core.record_sizing import (
    WRITING,
    SizingConfiguration,
    SizingEvaluationSettings,
    SizingLengths,
    SizingPeak,
    SizingResult,
    SizingWorstBatch,
    peak_of,
    recommendation_of,
)
from tunelab.core.record_types import Sizing
from tunelab.stages.sizing.terms import DTYPE_BYTES, Case, ModelFacts

CLASSIFYING = ("classification", "image_classification")


def _batch(worst: dict[str, Any]) -> SizingWorstBatch:
    """`find_worst_batch`'s result, read as the record's piece."""
    return SizingWorstBatch.of(WRITING, worst, "worst_batch_peak.batch")


def _settings(settings: dict[str, Any]) -> SizingEvaluationSettings:
    """`evaluation_settings`' result, read as the record's piece."""
    return SizingEvaluationSettings.of(WRITING, settings, "evaluation_peak.settings")


def find_worst_batch(
    lengths: list[int], training: Any, architecture: str, steps: int
) -> dict[str, Any]:
    """The run's micro-batch with the most tokens, in the trainer's seeded order.

    `lengths`: the encoded training examples' token counts in snapshot order (the order the
    trainer indexes). Packed rows cost their total tokens; padded ones rows x their longest.
    Returns {step (1-based), micro_batch_index, lengths, tokens, padded_tokens, packed,
    steps_scanned, seed}."""
    from tunelab.stages.train.batches import DataOrder, Position, StepSource

    t = training
    packed = bool(t.packing and architecture == "causal_lm")
    source = StepSource(
        lengths, DataOrder(len(lengths), t.seed), t.micro_batch_size, t.grad_accum_steps,
        0, architecture, packed,
    )  # fmt: skip
    position, best = Position(), (-1, 0, 0, [])
    for step in range(1, steps + 1):
        micro_batches, position = source.step_pairs(position)
        for k, pairs in enumerate(micro_batches):
            found = [lengths[i] for _, i in pairs]
            cost = sum(found) if packed else max(found) * len(found)
            if cost > best[0]:
                best = (cost, step, k, found)
    _, step, k, found = best
    return {
        "step": step,
        "micro_batch_index": k,
        "lengths": found,
        "tokens": sum(found),
        "padded_tokens": max(found) * len(found),
        "packed": packed,
        "steps_scanned": steps,
        "seed": t.seed,
    }


def worst_case(template: Case, worst: dict[str, Any]) -> Case:
    """The analytic model's case of the worst micro-batch (one accumulation step: the batch
    alone): one packed row of its total tokens, or its rows padded to the longest."""
    batch = _batch(worst)
    found = batch.lengths
    if batch.packed:
        return replace(template, seq_len=sum(found), micro_batch=1, grad_accum=1, packing=True)
    return replace(
        template, seq_len=max(found), micro_batch=len(found), grad_accum=1, packing=False,
        masked=len(set(found)) > 1,
    )  # fmt: skip


def evaluation_kind(cfg: Any, architecture: str) -> str:
    """ "generation" (a causal LM writing its answer with a KV cache) or "forward" (a
    classifier's scoring forward)."""
    generative = architecture == "causal_lm" and cfg.task.kind not in CLASSIFYING
    return "generation" if generative else "forward"


def evaluation_settings(cfg: Any, architecture: str, tokens: int) -> dict[str, Any]:
    """What `tunelab eval` runs at its worst batch: `tokens` is the longest prompt (generation),
    the longest scored sequence (a classifier), or an image model's patch tokens or side."""
    ev = cfg.evaluation
    kind = evaluation_kind(cfg, architecture)
    return {
        "kind": kind,
        "batch_size": ev.batch_size,
        "tokens": int(tokens),
        "max_new_tokens": ev.max_new_tokens if kind == "generation" else 0,
    }


def _compute_bytes(facts: ModelFacts, precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else DTYPE_BYTES.get(facts.param_dtype, 4)


def evaluation_increase(
    facts: ModelFacts, settings: dict[str, Any], precision: str = "fp32"
) -> dict[str, Any] | None:
    """Bytes evaluation adds to a process holding the model, no gradients kept, or None for a
    model the formula does not follow (a conv net: measured only).

    Generation: the KV cache of every layer at prompt + new tokens for the batch, the moment
    of the prefill (the cache of the prompt, a block's MLP or attention tensors over all prompt
    tokens, the last position's logits) and the moment of the last decoding step (the whole
    cache, and one layer's keys copied as the cache grows by concatenation). A forward: a
    block's largest moment over batch x tokens, and the logits (a causal LM scores every
    position over the vocabulary)."""
    if facts.conv:
        return None
    cd = _compute_bytes(facts, precision)
    st = _settings(settings)
    b, tokens = st.batch_size, st.tokens
    hidden, inter = facts.hidden, facts.intermediate
    if facts.stages:  # Swin: its first stage has the most tokens
        first = facts.stages[0]
        tokens, hidden, inter = first["grid"] ** 2, first["hidden"], first["intermediate"]
    if facts.moe:
        inter = int(facts.moe["expert_intermediate"]) * int(facts.moe["top_k"])
    kv_width = facts.kv_heads * facts.head_dim
    n = b * tokens
    attention = n * (3 * hidden + 2 * kv_width) * cd  # x, h, q, k, v and the output
    # the residual stream, the normed input, the down projection and their sum; the
    # activation, up and their product
    mlp = n * (4 * hidden + 3 * inter) * cd
    block = max(attention, mlp)
    if st.kind != "generation":
        vocab = facts.vocab if facts.architecture == "causal_lm" else max(1, facts.num_labels)
        logits = 2 * n * vocab * 4 if facts.architecture == "causal_lm" else b * vocab * 4
        return {"block": block, "logits": logits, "kv_cache": 0, "increase": block + logits}
    total = tokens + st.max_new_tokens
    per_token = 2 * facts.layers * kv_width * cd  # keys and values of every layer
    logits = 2 * b * facts.vocab * 4
    prefill = b * tokens * per_token + block + logits
    last = b * total * per_token + b * kv_width * total * cd + logits
    return {
        "block": block,
        "logits": logits,
        "kv_cache": b * total * per_token,
        "prefill": prefill,
        "last_step": last,
        "increase": max(prefill, last),
    }


def peak_total(peak: dict[str, Any] | None) -> int | None:
    """The bytes of a peak the budget holds (`core.record_sizing.SizingPeak.total`) for a peak
    not read back from its record (the one `tunelab size` is writing); None when neither the
    measured nor the predicted figure is known."""
    if not peak:
        return None
    return SizingPeak.of(Path("sizing record"), peak, "peak").total


def planning_peak_bytes(sizing: Sizing) -> tuple[int | None, str]:
    """The peak a plan must provision from a sizing record, and which it is: the larger of the
    training recommendation's, the worst batch's and the evaluation's."""
    rec = recommendation_of(sizing)
    found = {"training": rec.predicted_peak_bytes if rec.fits else None}
    for name, key in (("worst batch", "worst_batch_peak"), ("evaluation", "evaluation_peak")):
        peak = peak_of(sizing, key)
        found[name] = peak.total if peak is not None else None
    known = {k: int(v) for k, v in found.items() if v}
    if not known:
        return None, "none"
    which = max(known, key=lambda k: known[k])
    return known[which], which


def evaluation_refusal(
    evaluation_bytes: int,
    budget_bytes: int,
    settings: dict[str, Any],
    weights_bytes: int,
    fixed_bytes: int = 0,
    device: str = "GPU",
) -> str | None:
    """Why a layout does not fit because its evaluation cannot (None when it can): `tunelab
    eval` and `tunelab baseline` load the whole model on one device, whatever the training
    layout, so its peak `evaluation_bytes` must fit one GPU of `budget_bytes` (`fixed_bytes`
    of it taken by the runtime before the weights). The way out
    names a `device` with more memory, and a smaller evaluation batch where the weights alone
    fit."""
    if evaluation_bytes <= budget_bytes:
        return None
    st = _settings(settings)
    batch = f"evaluation.batch_size {st.batch_size} x {st.tokens} tokens"
    if st.kind == "generation":
        batch += f" + {st.max_new_tokens} new"
    fix = f"a {device} with more memory"
    if fixed_bytes + weights_bytes < budget_bytes:
        fix += ", or a smaller evaluation.batch_size or evaluation.max_new_tokens"
    else:
        fix += f" (the weights alone are {weights_bytes / 1e9:.1f} GB)"
    return (
        f"the evaluation does not fit: {evaluation_bytes / 1e9:.1f} GB on one {device}, over its "
        f"{budget_bytes / 1e9:.1f} GB (tunelab eval and baseline load the whole model on one "
        f"device; {batch}): use {fix}"
    )


def plan_peak(
    training_bytes: int,
    facts: ModelFacts,
    cfg: Any,
    tokens: int,
    precision: str,
    budget_bytes: int,
    fixed_bytes: int = 0,
    gpus: int = 1,
) -> tuple[int, str | None]:
    """For `tunelab plan` on a card: (the peak to provision, why it does not fit or None).

    The evaluation runs on one card whatever the layout: `fixed_bytes`, the whole weights and
    `evaluation_increase` at the study's evaluation settings over `tokens`, the longest
    sequence (`evaluation_refusal` when that is over the card). On one card the peak is the
    larger of the training peak (`training_bytes`, `fixed_bytes` included) and the
    evaluation's; over several `gpus` it is the training peak of each rank."""
    settings = evaluation_settings(cfg, facts.architecture, tokens)
    added = evaluation_increase(facts, settings, precision)
    if added is None:
        return training_bytes, None
    evaluation = fixed_bytes + facts.total_weight_bytes + added["increase"]
    peak = max(training_bytes, evaluation) if gpus == 1 else training_bytes
    return peak, evaluation_refusal(
        evaluation, budget_bytes, settings, facts.total_weight_bytes, fixed_bytes
    )


# ------------------------------------------------------------------ within `tunelab size`

WORST_LABEL = "worst batch"
EVALUATION_LABEL = "evaluation"


def evaluation_tokens(pre: Any, snapshot: Any, cfg: Any, architecture: str, longest: int) -> int:
    """The longest sequence `tunelab eval` feeds at once, over the validation split (the first
    `evaluation.max_examples`): a generating task's inference prompt, a causal classifier's
    prompt with its longest label, an encoder's input; `longest` (the training maximum) when
    the split is empty. The test split stays sealed: it is never read here."""
    ev = cfg.evaluation
    rows = list(snapshot.rows("validation"))[: ev.max_examples or None]
    if not rows:
        return longest
    if evaluation_kind(cfg, architecture) == "generation":
        return max(len(pre.prompt_ids(r, generate=ev.max_new_tokens)) for r in rows)
    if architecture == "causal_lm":  # every (example, label) pair is scored
        return max(len(c["input_ids"]) for r in rows for c in pre.encode_candidates(r))
    return max(len(pre.encode(r)["input_ids"]) for r in rows)


def worst_settings(cfg: Any, steps: int, snapshot: str | None) -> dict[str, Any]:
    """What decides the worst batch: the train-start check compares them with the run's."""
    t = cfg.training
    keys = ("micro_batch_size", "grad_accum_steps", "seed", "packing")
    return {**{k: getattr(t, k) for k in keys}, "steps": steps, "snapshot": snapshot}


def peak_options(
    cfg: Any, architecture: str, own: Any, lengths: dict[str, Any]
) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """The peaks `tunelab size` measures beside its configurations, each (Option, what its
    spec adds, what the record keeps): the worst batch (when the snapshot's lengths are
    known) and the evaluation."""
    from tunelab.stages.train.schedule import total_steps

    out = []
    known = SizingLengths.of(WRITING, lengths, "lengths")
    if known.order:
        steps = total_steps(cfg, len(known.order))
        worst = find_worst_batch(known.order, cfg.training, architecture, steps)
        found = _batch(worst).lengths
        o = replace(
            own, label=WORST_LABEL, seq_len=max(found), micro_batch=len(found), grad_accum=1
        )
        settings = worst_settings(cfg, steps, known.snapshot)
        out.append(
            (o, {"peak": "worst_batch", "lengths": found}, {"batch": worst, "settings": settings})
        )
    tokens = int(known.evaluation_tokens or own.seq_len)
    settings = evaluation_settings(cfg, architecture, tokens)
    o = replace(
        own, label=EVALUATION_LABEL, seq_len=tokens, micro_batch=_settings(settings).batch_size,
        grad_accum=1, checkpointing=False,
    )  # fmt: skip
    out.append((o, {"peak": "evaluation", "evaluation": settings}, {"settings": settings}))
    return out


def _pct(pred: float | None, real: float | None) -> float | None:
    return round(100.0 * (pred - real) / real, 2) if pred and real else None


def _measured(row: SizingConfiguration, cuda: bool) -> tuple[dict[str, Any], int | None]:
    """The row's measurement as the peak keeps it, with the figure the prediction is set
    against (`compared`), and that figure."""
    found = row.measurement
    compared = found.peak_total if cuda else found.increase
    return {**(row.measured or {}), "compared": compared}, compared


def _outcome(row: SizingConfiguration, predicted: int | None, measured: int | None) -> Any:
    """A peak's status, reason and error (None where it was not measured)."""
    error = _pct(predicted, measured) if row.status == "ok" else None
    return row.status, row.reason, error


def worst_record(
    row: SizingConfiguration,
    kept: dict[str, Any],
    facts: ModelFacts,
    template: Case,
    device: str,
    idle_bytes: int = 0,
) -> dict[str, Any]:
    """`worst_batch_peak`: the batch (step, lengths), its predicted and measured peak
    (`idle_bytes`: the idle process where this one was not measured)."""
    from tunelab.stages.sizing.memory import estimate_memory

    cuda = device == "cuda"
    case = worst_case(template, SizingPeak.of(WRITING, kept, "worst_batch_peak").batch or {})
    est = estimate_memory(facts, case)
    m, measured = _measured(row, cuda)
    idle = row.measurement.idle_rss or idle_bytes
    compared = est.peak_total if cuda else est.peak_increase
    predicted = {
        "peak_total": est.peak_total,
        "peak_increase": est.peak_increase,
        "peak_phase": est.peak_phase,
        "compared": compared,
        "total": est.peak_total if cuda else idle + compared,
    }
    status, reason, error = _outcome(row, compared, measured)
    return {
        **kept,
        "status": status,
        "reason": reason,
        "case": {"seq_len": case.seq_len, "micro_batch": case.micro_batch, "packing": case.packing},
        "predicted": predicted,
        "measured": m,
        "error_pct": error,
    }


def evaluation_record(
    row: SizingConfiguration,
    kept: dict[str, Any],
    facts: ModelFacts,
    precision: str,
    device: str,
    idle_bytes: int = 0,
) -> dict[str, Any]:
    """`evaluation_peak`: the settings (kind, batch_size, tokens, max_new_tokens), the
    predicted increase (`evaluation_increase`) and the measured one (`idle_bytes`: the idle
    process where the evaluation's was not measured, e.g. stopped over the budget)."""
    cuda = device == "cuda"
    settings = SizingPeak.of(WRITING, kept, "evaluation_peak").settings or {}
    found = evaluation_increase(facts, settings, precision)
    m, measured = _measured(row, cuda)
    predicted: dict[str, Any] = {"modelled": found is not None}
    compared = None
    if found is not None:
        increase = found["increase"]  # evaluation_increase's own working figures
        compared = facts.total_weight_bytes + increase if cuda else increase
        total = compared if cuda else (row.measurement.idle or idle_bytes) + compared
        predicted.update(found, compared=compared, total=total)
    status, reason, error = _outcome(row, compared, measured)
    return {
        **kept,
        "status": status,
        "reason": reason,
        "predicted": predicted,
        "measured": m,
        "error_pct": error,
    }


class SizingInternalError(RuntimeError):
    """A sizing attempt failed with an unexpected exception (tunelab's fault, not the
    configuration's size): reported as an internal error with the child's traceback."""


def refuse_unmeasured(rows: list[dict[str, Any]], facts: ModelFacts | None) -> None:
    """Nothing measured: an internal error when an attempt raised (its traceback kept), else
    the user's way out (every configuration was over the memory)."""
    if facts is not None:
        return
    found = [SizingResult.of(WRITING, r, f"configurations[{i}]") for i, r in enumerate(rows)]
    errors = [r for r in found if r.status == "error"]
    if errors:
        first = errors[0]
        raise SizingInternalError(
            f"tunelab size could not measure {len(errors)} of {len(rows)} configurations: "
            f"{first.label}: {first.reason}\n{first.traceback or ''}"
        )
    reasons = "; ".join(f"{r.label}: {r.status} {r.reason or ''}" for r in found)
    raise TunelabError(
        f"no configuration could be measured: {reasons[:1500]}",
        hint="lower --micro-batch / --seq-len, or raise --memory-budget",
    )


def peak_records(
    peaks: list[tuple[Any, dict[str, Any], dict[str, Any]]],
    rows: dict[Any, SizingConfiguration],
    facts: ModelFacts,
    template: Case,
    device: str,
    idle_bytes: int = 0,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(`worst_batch_peak`, `evaluation_peak`), None where not measured; `idle_bytes`: the
    idle process of the configurations, for a peak whose own was not measured."""
    worst = evaluation = None
    for o, _, kept in peaks:
        row, idle = rows[o.label], idle_bytes
        if o.label == WORST_LABEL:
            worst = worst_record(row, kept, facts, template, device, idle)
        elif o.label == EVALUATION_LABEL:
            precision = template.precision
            evaluation = evaluation_record(row, kept, facts, precision, device, idle)
    return worst, evaluation
