"""The measured inputs of a plan, read from the study's records, each with where it came from.

- step time and throughput, model load, a validation forward: the latest sizing record (`tunelab
  size`), scaled from the measured length to the data's own token counts;
- checkpoint save, fresh-process reload, a new process's start: the latest smoke record;
- an evaluation: the baseline's (`tunelab baseline`), the unit every variant's evaluation
  repeats, with what a variant adds to it (its load, its answers' length, its adapter);
- the durations of smoke, sizing and baseline themselves, from the ledger and the records.

`Figure(value, source)`, `Figures`, `gather_figures(study) -> Figures`. A variant's evaluation:
`baseline_s`, `baseline_load_s`, `eval_load_s` (the smoke's fresh-process load),
`answer_length_s_per_example` (a generating task's baseline batches priced again at their gold
answers' length less what they generated, per example; negative when the base rambled longer),
`adapted_extra_s_per_example` ((the baseline's seconds per example + that) x (the smoke's
`adapter_time_ratio` - 1), else LoRA's parameter share), `variant_s_per_step` (the baseline's
decoding step x the ratio, x 1 when the smoke's evaluation chose the merged copy, which then adds
`eval_merge_s` once per evaluation: `merged_evaluation`), `eval_max_examples` (caps every
evaluation, not training's validation passes). The smoke and the baseline are
found by `core.evidence` (`latest(study, "smoke", "smoke.json")`, `latest_baseline`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from tunelab.core.errors import StudyError
from tunelab.core.evidence import latest, latest_baseline
from tunelab.core.record_checks import FoundEvaluation
from tunelab.core.record_plan import DecodingBatch, PlanModelFacts
from tunelab.core.record_sizing import (
    env_of,
    lengths_of,
    measured_of,
    options_of,
    throughput_of,
)
from tunelab.core.record_types import Evaluation, Sizing, Smoke
from tunelab.core.run_parts import SizingRow
from tunelab.core.study import Study
from tunelab.lib import probes


@dataclass(frozen=True)
class Figure:
    """A number and where it came from (None: not measured)."""

    value: float | None
    source: str

    @property
    def seconds(self) -> float:
        """The value as the estimate adds it up: nothing measured counts as 0."""
        return float(self.value or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


@dataclass(frozen=True)
class SplitCounts:
    train: int
    validation: int
    test: int


@dataclass(frozen=True)
class Lengths:
    """Tokens per training example (None: no length distribution recorded)."""

    p50: float | None = None
    p95: float | None = None
    max: float | None = None
    mean: float | None = None


@dataclass
class Figures:
    """Everything `build_plan` reads. The optional figures price a variant's evaluation beside
    the baseline's and exist only when a baseline was measured."""

    device: str
    sizing_id: str | None
    step_s: Figure
    forward_s: Figure
    load_s: Figure
    encode_s: Figure
    sizing_s: Figure
    tokens_per_s: Figure
    counts: SplitCounts
    lengths: Lengths
    eval_s_per_example: Figure
    checkpoint_save_s: Figure
    reload_s: Figure
    smoke_s: Figure
    process_start_s: Figure
    baseline_s: Figure
    base_hash_s: Figure
    method: str = "lora"
    eval_max_examples: int | None = None
    step_cpu_share: float | None = None
    baseline_cpu_share: float | None = None
    load_avg_at_sizing: float | None = None
    logical_cores: int | None = None
    baseline_load_s: Figure | None = None
    eval_load_s: Figure | None = None
    answer_length_s_per_example: Figure | None = None
    adapted_extra_s_per_example: Figure | None = None
    variant_s_per_step: Figure | None = None
    eval_merge_s: Figure | None = None

    def to_dict(self) -> dict[str, Any]:
        """{name: {value, source}} for figures, plain values for the rest; absent optionals left
        out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Figure):
                out[f.name] = value.to_dict()
            elif isinstance(value, SplitCounts | Lengths):
                out[f.name] = asdict(value)
            elif value is not None or "Figure" not in str(f.type):
                out[f.name] = value
        return out


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def run_seconds(row: Any) -> float | None:
    """created_at -> finished_at of a ledger row, in seconds (None while it runs)."""
    start, end = _parse_time(row.created_at), _parse_time(row.finished_at)
    return (end - start).total_seconds() if start and end else None


def expected_max(quantiles: list[int], m: int) -> float:
    """E[max of m lengths drawn from the quantile function]: the padded length of a batch of m."""
    if not quantiles:
        return 0.0
    n = len(quantiles) - 1
    total = 0.0
    for i in range(n):
        u0, u1 = i / n, (i + 1) / n
        total += (quantiles[i] + quantiles[i + 1]) / 2 * (u1**m - u0**m)
    return total


def split_counts(study: Study, recorded: dict[str, Any]) -> SplitCounts:
    """Examples per split: the latest snapshot's manifest, else what the sizing recorded."""
    from tunelab.core.errors import SnapshotError
    from tunelab.stages.data import load_snapshot

    try:
        final = load_snapshot(study).counts
    except SnapshotError:
        final = recorded
    return SplitCounts(
        *(int(final.get(k) or recorded.get(k) or 0) for k in ("train", "validation", "test"))
    )


def _own_row(sizing: Sizing) -> SizingRow:
    """The sizing row of the study's own configuration, which must have been measured."""
    thr = throughput_of(sizing)
    own = next((r for r in sizing.rows if r.label == thr.row), None)
    if own is None or own.status != "ok" or not thr.step_s:
        raise StudyError(
            f"sizing {sizing.id} has no measured step of the study's configuration",
            hint="run `tunelab size` again (its first configuration must fit)",
        )
    return own


def _smoke_figures(smoke: Smoke | None, row: Any, load_s: Figure) -> dict[str, Figure]:
    if smoke is None:
        return {
            "checkpoint_save_s": Figure(None, "no smoke record"),
            "reload_s": Figure(load_s.value, "no smoke record: the sizing's load time"),
            "smoke_s": Figure(None, "no smoke record (run `tunelab smoke`)"),
            "process_start_s": Figure(None, "no smoke record"),
        }
    sm = f"smoke {row.id}"
    start = (smoke.fresh_process_s or 0) - (smoke.reload_s or 0)
    start -= (smoke.fresh_eval_s or 0) + (smoke.fresh_checks_s or 0)
    return {
        "checkpoint_save_s": Figure(smoke.checkpoint_save_s, sm),
        "reload_s": Figure(smoke.reload_s, f"{sm}: load in a fresh process"),
        "smoke_s": Figure(run_seconds(row) or smoke.total_s, f"{sm}: ledger"),
        "process_start_s": Figure(
            start if start > 0 else None,
            f"{sm}: its fresh process less the load, the evaluation and the smoke's own checks "
            "(start, imports, records)",
        ),
    }


def gather_figures(study: Study) -> Figures:
    """The measured inputs of a plan, each with its source. Needs a sizing record."""
    from tunelab.stages.sizing.record import require_sizing

    cfg = study.config
    sizing = require_sizing(study)
    own = _own_row(sizing)  # refuses a sizing without the study's own step
    thr = throughput_of(sizing)
    facts = facts_of(sizing)
    m = measured_of(own)
    lengths = lengths_of(sizing)
    quant = lengths.quantiles or []
    measured_len = options_of(own).seq_len
    architecture = facts.architecture
    packing = bool(cfg.training.packing and architecture == "causal_lm")
    micro = cfg.training.micro_batch_size
    conv = bool(facts.conv)
    image = architecture == "image"  # every image at one size
    if conv:
        typical, how = measured_len, "every image at that side"
    elif image:
        typical, how = measured_len, "every image at that size"
    elif quant:
        typical = lengths.mean if packing else expected_max(quant, micro)
        how = "mean length (packed)" if packing else f"expected longest of {micro} (padded)"
    else:
        typical, how = measured_len, "the measured length (--seq-len: no length distribution)"
    scale = (typical or measured_len) / measured_len
    per_example = "px a side" if conv else ("patch tokens/image" if image else "tokens/example")
    sid = f"sizing {sizing.id}"
    load_s = Figure(m.load_s, f"{sid}: model load and adaptation")
    found = latest(study, "smoke", "smoke.json")
    smoke, smoke_row = (Smoke.read(found.path), found.row) if found else (None, None)
    env = env_of(sizing)
    step_s = thr.step_s or 0.0  # `_own_row` refuses a sizing without it
    f = Figures(
        device=sizing.device,
        sizing_id=sizing.id,
        step_s=Figure(
            step_s * scale,
            f"{sid}: {step_s:.3f} s at {measured_len} {per_example} x {scale:.3f} ({how})",
        ),
        forward_s=Figure(
            (m.forward_s or 0.0) * scale, f"{sid}: one validation forward of a micro-batch"
        ),
        load_s=load_s,
        encode_s=Figure(lengths.encode_train_s, f"{sid}: tokenizing the training split"),
        sizing_s=Figure(sizing.seconds, f"{sid}: its own duration"),
        tokens_per_s=Figure(thr.tokens_per_s, sid),
        counts=split_counts(study, lengths.split_counts or {}),
        lengths=Lengths(lengths.p50, lengths.p95, lengths.max, lengths.mean),
        eval_s_per_example=Figure(None, ""),
        baseline_s=Figure(None, "no baseline yet: estimated"),
        base_hash_s=base_hash_seconds(study),
        method=cfg.adaptation.method,
        eval_max_examples=cfg.evaluation.max_examples,
        step_cpu_share=m.cpu_share,
        load_avg_at_sizing=env.load_avg_1m,
        logical_cores=env.logical_cores,
        **_smoke_figures(smoke, smoke_row, load_s),
    )
    _baseline_figures(study, f, smoke, smoke_row, facts)
    if f.eval_s_per_example.value is None and smoke is not None:
        f.eval_s_per_example = Figure(
            smoke.eval_s_per_example, f"smoke {smoke_row.id}: a few examples (high)"
        )
    if f.eval_s_per_example.value is None:
        # a forward per example: right for a classifier, low for generation
        f.eval_s_per_example = Figure(
            f.forward_s.seconds / max(1, micro), "estimated from the validation forward (low)"
        )
    if f.checkpoint_save_s.value is None:
        f.checkpoint_save_s = Figure(1.0, "assumed 1 s (no smoke record)")
    return f


def baseline_record(study: Study) -> tuple[Any, Evaluation | None]:
    """The latest baseline's ledger row and its validation metrics record
    (`core.evidence.latest_baseline`), or (None, None)."""
    found = latest_baseline(study, "validation")
    if not found:
        return None, None
    row, evaluation = found
    return row, FoundEvaluation.of(evaluation, "validation").record


def _baseline_figures(
    study: Study, f: Figures, smoke: Smoke | None, smoke_row: Any, facts: PlanModelFacts
) -> None:
    """The baseline's evaluation, the very procedure every variant's evaluation repeats."""
    row, rec = baseline_record(study)
    if row is None or rec is None:
        return
    f.baseline_s = Figure(run_seconds(row), f"baseline {row.id}: ledger")
    f.baseline_cpu_share = rec.cpu_share
    if not (rec.seconds and rec.n):
        return
    f.eval_s_per_example = Figure(
        rec.seconds / rec.n, f"baseline {row.id}: {rec.n} examples evaluated"
    )
    smoke_eval = None
    if smoke_row is not None:
        path = study.runs_dir / smoke_row.id / "metrics-validation.json"
        smoke_eval = Evaluation.read(path) if path.exists() else None
    costs = adapted_costs(
        smoke,
        smoke_row.id if smoke_row is not None else None,
        rec,
        row.id,
        facts,
        study.config.adaptation.method,
        merged=merged_evaluation(smoke_eval, study.config.evaluation.batch_size),
    )
    for name, figure in costs.items():
        setattr(f, name, figure)


def merged_evaluation(smoke_eval: Evaluation | None, batch_size: int) -> Figure | None:
    """The fixed cost of evaluating a variant merged, from the smoke's evaluation when it chose
    the merged copy (`tunelab.lib.inference.eval_copy`), else None: building the copy, plus the first batch's
    check, which the smoke ran on its few examples and a full batch repeats in proportion."""
    merge = smoke_eval.eval_copy if smoke_eval is not None else None
    if smoke_eval is None or merge is None or not merge.merged or merge.merge_s is None:
        return None
    n = max(1, smoke_eval.n)
    check = (merge.check_s or 0.0) * max(1.0, batch_size / n)
    return Figure(
        merge.merge_s + check,
        f"smoke {smoke_eval.run_id}: evaluated merged ({merge.reason}); the copy "
        f"took {merge.merge_s:.2f} s, its check {merge.check_s or 0:.2f} s on {n} "
        f"examples, scaled to a batch of {batch_size}",
    )


def adapted_costs(
    smoke: Smoke | None,
    smoke_id: str | None,
    rec: Evaluation,
    baseline_id: str,
    facts: PlanModelFacts,
    method: str,
    merged: Figure | None = None,
) -> dict[str, Figure]:
    """What a variant's evaluation costs beside the baseline's run, which is its unit of work.

    - its load: the smoke's fresh process loading an adapted checkpoint, in place of the
      baseline's own load. The baseline is the first process to read the model's files after
      the data stages (a cold file cache); the smoke's reload comes after it and loads what a
      variant loads.
    - per example, for a generating task: the length it will generate, its answers' and not the
      baseline's (`answer_length_cost`); the adapter's cost below applies to that.
    - per example: unmerged LoRA layers add their own matmuls and calls, more than their share
      of the parameters at a decoding step. The smoke measures it with the adapter off, then on
      (`tunelab.lib.probes.adapter_time_ratio`); without that figure, the adapter's share of
      the parameters (from the sizing's facts), which is right for the FLOPs of a large batch.
      The smoke's own per-example time is not used: its few examples are one small batch
      whose per-example time holds the first batch's fixed costs.
    - `merged` (`merged_evaluation`): where the smoke's evaluation chose the merged copy, a
      variant runs at the base's speed (no adapter cost per example or step) and pays the
      copy and its check once per evaluation (`eval_merge_s`).
    """
    out: dict[str, Figure] = {}
    per_example = (rec.seconds or 0.0) / rec.n
    length = answer_length_cost(rec, baseline_id)
    if length is not None:
        out["answer_length_s_per_example"] = length
        per_example = max(0.0, per_example + length.seconds)
    if rec.load_s is not None:
        out["baseline_load_s"] = Figure(rec.load_s, f"baseline {baseline_id}: its model load")
    reload = smoke.reload_s if smoke else None
    if reload is not None:
        out["eval_load_s"] = Figure(
            reload,
            f"smoke {smoke_id}: an adapted checkpoint loaded in a fresh process, after the "
            "baseline",
        )
    ratio = smoke.adapter_time_ratio if smoke else None
    trainable, total = facts.trainable_params or 0, facts.num_params or 0
    step = rec.decoding.s_per_step if rec.decoding is not None else None
    if merged is not None:
        out["eval_merge_s"] = merged
        if step:
            out["variant_s_per_step"] = Figure(
                step,
                f"baseline {baseline_id}: {1000 * step:.0f} ms a decoding step; merged, a "
                "variant decodes as the base",
            )
        return out
    if step:
        adapted = max(1.0, ratio) if method == "lora" and ratio is not None else 1.0
        out["variant_s_per_step"] = Figure(
            step * adapted,
            f"baseline {baseline_id}: {1000 * step:.0f} ms a decoding step"
            + (f", x {adapted:.2f} with the adapter" if adapted != 1.0 else ""),
        )
    if method == "lora" and ratio is not None:
        out["adapted_extra_s_per_example"] = Figure(
            per_example * max(0.0, ratio - 1.0),
            f"smoke {smoke_id}: its examples took {ratio:.2f} times as long with the adapter on "
            "as with it off",
        )
    elif method == "lora" and 0 < trainable < total:
        share = trainable / (total - trainable)
        out["adapted_extra_s_per_example"] = Figure(
            per_example * share,
            f"LoRA's unmerged matmuls: {trainable:,} parameters over the base's "
            f"{total - trainable:,} ({100 * share:.2f} % more per example)",
        )
    return out


def answer_length_cost(rec: Evaluation, baseline_id: str) -> Figure | None:
    """Per example, what generating the gold answers' length takes beyond what the baseline
    generated (negative: less), at the baseline's own prefill and step times, batch by batch.

    A trained variant stops after the answer it learned; the base model may ramble to
    `max_new_tokens`, and a variant priced at the baseline's length would be priced too long.
    None for a task that does not generate (classification) or a record without generation
    timings."""
    gen = rec.decoding
    batches = decoding_batches(rec)
    if gen is None or not batches or not rec.n:
        return None
    answered = 0.0
    for b in batches:  # each batch's timings as `tunelab eval` wrote them
        step = b.decode_s / (b.steps - 1) if b.steps > 1 else gen.s_per_step or 0
        answered += b.prefill_s + max(0, b.answer_steps - 1) * step
    generated = sum(b.prefill_s + b.decode_s for b in batches)
    return Figure(
        (answered - generated) / rec.n,
        f"baseline {baseline_id}: {gen.steps} generated tokens in {len(batches)} batches; "
        f"the validation answers (tokens and EOS) take {gen.answer_steps}",
    )


def decoding_batches(rec: Evaluation) -> list[DecodingBatch]:
    """The generated batches of an evaluation ([] for one that does not generate)."""
    return rec.decoding.parts(DecodingBatch, "batches") if rec.decoding is not None else []


def facts_of(sizing: Sizing | None) -> PlanModelFacts:
    """The adapted model's facts a sizing recorded (all None without a sizing or facts)."""
    if sizing is None:
        return PlanModelFacts(Path("records/sizing"), {}, where="facts")
    return sizing.part(PlanModelFacts, "facts") or PlanModelFacts(sizing.path, {}, where="facts")


def base_hash_seconds(study: Study) -> Figure:
    """Seconds to sha256 the base model's files: their size over a hashing rate measured now."""
    from tunelab.lib.models.identity import identity_files
    from tunelab.lib.models.loading import base_folder

    path = base_folder(study.config.model, study.root)
    try:
        # the files the export's identity check hashes
        files = [path / n for n in identity_files(path)] if path.is_dir() else [path]
        size = sum(p.stat().st_size for p in files)
    except OSError as exc:
        return Figure(None, f"base files not readable ({exc.strerror}): hashing not counted")
    rate = probes.hash_rate()
    return Figure(size / rate, f"{size / 2**20:.0f} MiB of base files at {rate / 2**20:.0f} MiB/s")
