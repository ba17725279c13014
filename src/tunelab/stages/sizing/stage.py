"""`tunelab size`: measure real steps of the study's model, set beside the analytic breakdown.

1. Representative lengths (`sizing.lengths`): the training split of the latest data snapshot goes through the
   study's own preprocessing; its p95 and maximum token counts (or `--seq-len`) and the share of
   positions carrying loss are what the synthetic examples of the measurement reproduce.
2. Configurations (`recommend.configurations`): the study's own at each length, then each
   option alone at the longest length (activation checkpointing, micro-batch sizes, precision),
   then combined. All are measured in one child process (`processes.measure_configurations`:
   imports and the model's files paid once, the model built again for each, its memory given
   back in between), or each in its own (`--fresh-processes`, and `--allocator default`).
3. For each: the analytic estimate (`memory.estimate_memory`), the measurement, the error in
   percent, and what the weights x 4 rule would have said.
4. The recommendation (micro-batch, accumulation, within the memory budget) with its measured
   tokens/s, and the per-rank projection for DDP and FSDP over N ranks.
5. The steps that really peak (`sizing.peaks`), measured last in the same process: the worst
   micro-batch of the run's seeded order (the snapshot's lengths) and the evaluation's largest
   batch (generation with its KV cache, or a classifier's forward): `worst_batch_peak` and
   `evaluation_peak`, each predicted and measured; `tunelab train` checks them
   (`sizing.gate`).
6. `records/sizing/<id>.json` (never overwritten, `sizing.record`), read by `tunelab plan`.

The progress line and its time forecast are `sizing.forecast`'s.

What is compared: on CUDA the predicted peak total against `max_memory_allocated`; on CPU the
predicted increase (optimizer states, gradients, activations, logits, temporaries) against the
measured peak RSS above the idle process (model, optimizer and batch loaded).

`run(..., methods=[...])` (`tunelab size --methods full,lora,qlora`) adds a row per other
method (`label` "method M") at the study's own configuration, each predicted from its own facts;
`recommendation.other_methods` [{method, fits, micro_batch, grad_accum, checkpointing,
predicted_peak_bytes}] (the CLI proposes one that fits when the study's does not). An image
model's "sequence length" is its patch tokens (`tunelab.lib.models.vision.patch_tokens`), or for
a conv net its square image side (`lengths.conv_image_side(base, cfg)`; the lengths record gains
`image_size` and `length_unit` "patch tokens" | "image side"); any other image model is refused
(ModelError); `lengths.supports_checkpointing(study)` drops the checkpointing configurations of a model
that cannot checkpoint.

`records/sizing/<size-id>.json` (the latest: `core.evidence.latest(study, "sizing")`): `device`, `seconds`, `lengths {p50,
p95, max, mean, quantiles, loss_fraction, split_counts, encode_train_s}`, `configurations:
[{label, method, options {seq_len, micro_batch, grad_accum, measured_accum, precision,
checkpointing, packing}, status (ok | does_not_fit | error), reason, predicted {...Estimate,
compared}, measured {step_s, projected_step_s, micro_step_s, tokens_per_s, forward_s,
forward_of, heap_grown_before, saved_activation_bytes, load_s, cpu_share, phase_s, idle_rss,
peak_rss, increase | max_allocated, max_reserved, compared}, error_pct, rule_x4 {bytes,
error_pct}, seq_len, micro_batch, predicted_mb, measured_mb, step_s, process {index,
position}}]`, `processes` (shared | fresh), `max_error_pct`, `rule_x4_max_error_pct`,
`recommendation {fits, micro_batch, grad_accum, checkpointing, precision, predicted_peak_bytes
(= fixed_bytes, the idle process's RSS on CPU and 0 on CUDA, + step_peak_bytes), budget_bytes,
tokens_per_s, ...}`, `projection: [{ranks, micro_batch, grad_accum, ddp, fsdp}]`, `throughput
{row, step_s, tokens_per_s}`, `step_s`, `tokens_per_s`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tunelab.core.config_training import TrainingConfig
from tunelab.core.progress import Progress
from tunelab.core.record_sizing import (
    WRITING,
    SizingConfiguration,
    SizingLengths,
    SizingOptions,
    SizingRecommendation,
    SizingResult,
)
from tunelab.core.study import Study
from tunelab.stages.sizing.forecast import PLANNED_TIME_STEPS, RowProgress, sizing_forecast
from tunelab.stages.sizing.lengths import (
    model_architecture,
    snapshot_lengths,
    study_lengths,
    supports_checkpointing,
)
from tunelab.stages.sizing.load import load_table
from tunelab.stages.sizing.memory import project_per_rank
from tunelab.stages.sizing.peaks import peak_options, peak_records, refuse_unmeasured
from tunelab.stages.sizing.processes import measure_configurations
from tunelab.stages.sizing.recommend import (
    Option,
    calibration,
    configurations,
    own_label,
    recommend,
)
from tunelab.stages.sizing.record import (
    as_configurations,
    compare_row,
    flatten_row,
    save_sizing,
    sizing_record,
)
from tunelab.stages.sizing.terms import Case, ModelFacts

DEFAULT_RANKS = (2, 4, 8)
MEASURED_ACCUM = 2  # micro-steps a measured step runs at most: the time of one scales to the rest


def device_memory_bytes(device: str) -> int:
    """Total memory of the device: the GPU's, or the machine's RAM on CPU."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class _Measurer:
    """Measures configurations (all in one process unless `shared` is off, see
    `processes.measure_configurations`); keeps the rows and the model facts the first
    successful one reports."""

    def __init__(
        self,
        base_spec: dict[str, Any],
        own: str,
        method: str,
        total: int,
        timeout_s: float,
        progress: Progress | None,
        shared: bool = True,
    ):
        self.base_spec, self.own, self.method, self.total = base_spec, own, method, total
        self.timeout_s, self.progress, self.shared = timeout_s, progress, shared
        self.rows: list[dict[str, Any]] = []
        self.facts: ModelFacts | None = None
        self.facts_of: dict[str, ModelFacts] = {}  # per row: another method's model
        self.extras: dict[str, dict[str, Any]] = {}  # per label: what its spec adds (peaks)

    def spec(self, o: Option, method: str | None) -> dict[str, Any]:
        """The child's spec for option `o` (with adaptation.method `method` instead of the
        study's): at most 2 micro-steps a step, the time per micro-step scales to the rest."""
        spec = {
            **self.base_spec,
            "label": o.label,
            "seq_len": o.seq_len,
            "micro_batch": o.micro_batch,
            "grad_accum": min(o.grad_accum, MEASURED_ACCUM),
            "precision": o.precision,
            "checkpointing": o.checkpointing,
            "packing": o.packing,
        }
        if o.label == self.own:
            spec["time_steps"] = PLANNED_TIME_STEPS
        if method is not None:
            adaptation = {**spec["config"]["adaptation"], "method": method}
            spec["config"] = {**spec["config"], "adaptation": adaptation}
        return {**spec, **self.extras.get(o.label, {})}

    def measure_all(
        self,
        queue: list[tuple[Option, str | None]],
        on_row: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        """Measure every (option, method) of `queue`; `on_row(index, row)` as each ends."""
        specs = [self.spec(o, m) for o, m in queue]
        rows: dict[int, dict[str, Any]] = {}

        def on_result(i: int, result: dict[str, Any]) -> None:
            rows[i] = self._row(*queue[i], specs[i], result)
            if on_row is not None:
                on_row(i, rows[i])

        measure_configurations(
            specs, timeout_s=self.timeout_s, shared=self.shared, on_result=on_result
        )
        self.rows += [rows[i] for i in range(len(queue))]

    def configurations(self) -> list[SizingConfiguration]:
        """The rows measured so far, read as the record's configurations."""
        return as_configurations(self.rows)

    def measure(self, o: Option, method: str | None = None, note: str = "") -> dict[str, Any]:
        """Measure option `o` alone (its own process); `note` follows its label on the
        progress line."""
        if self.progress:
            self.progress(
                "size", len(self.rows), self.total, o.label + (f"; {note}" if note else "")
            )
        self.measure_all([(o, method)])
        return self.rows[-1]

    def _row(
        self, o: Option, method: str | None, spec: dict[str, Any], result: dict[str, Any]
    ) -> dict[str, Any]:
        found = SizingResult.of(WRITING, result, f"the measurement of {o.label!r}")
        if found.facts and method is not None:
            self.facts_of[o.label] = ModelFacts.from_dict(found.facts)
        elif found.facts:
            self.facts = self.facts or ModelFacts.from_dict(found.facts)
        measured_accum = min(o.grad_accum, MEASURED_ACCUM)
        row: dict[str, Any] = {
            "label": o.label,
            "options": {**o.to_dict(), "measured_accum": measured_accum},
            "method": method or self.method,
            "status": found.status,
            "reason": found.reason,
            "measured": found.measured,
            "process": found.process,
        }
        step_s = found.measurement.step_s
        if found.measured and step_s:
            micro_s = step_s / measured_accum
            found.measured["micro_step_s"] = micro_s
            found.measured["projected_step_s"] = micro_s * o.grad_accum
        return row


def _case_of(
    opts: SizingOptions,
    facts: ModelFacts,
    t: TrainingConfig,
    *,
    loss_fraction: float,
    device: str,
    cuda_major: int,
    accum: int | None = None,
) -> Case:
    """The analytic model's case for a row's options (the accumulation measured, or `accum`)."""
    measured_accum = opts.grad_accum if opts.measured_accum is None else opts.measured_accum
    return Case(
        seq_len=opts.seq_len,
        micro_batch=opts.micro_batch,
        grad_accum=accum or measured_accum,
        precision=opts.precision or "fp32",
        checkpointing=bool(opts.checkpointing),
        packing=bool(opts.packing and facts.architecture == "causal_lm"),
        loss_fraction=loss_fraction,
        optimizer=t.optimizer,
        device=device,
        cuda_major=cuda_major,
    )


def _recommendation(
    measurer: _Measurer,
    case: Callable[..., Case],
    template: Case,
    *,
    largest: int,
    effective: int,
    budget: int,
    device: str,
    packing: bool,
    can_checkpoint: bool = True,
) -> dict[str, Any]:
    """The largest micro-batch that fits at the longest length, measured when no row has it."""
    facts, rows = measurer.facts, measurer.configurations()
    assert facts is not None
    ok = [r.measurement for r in rows if r.status == "ok"]
    idle = [m.idle_rss for m in ok if m.idle_rss]
    rec = recommend(
        facts,
        template,
        effective_batch=effective,
        budget_bytes=budget,
        fixed_bytes=0 if device == "cuda" else max(idle or [0]),
        compare_total=device == "cuda",
        scale=calibration(rows),
        can_checkpoint=can_checkpoint,
    )
    found = SizingRecommendation.of(WRITING, rec, "recommendation")
    if not found.fits:
        return rec
    shape = (largest, found.micro_batch, found.checkpointing, found.precision)
    match = next((r for r in rows if _shape(r.options) == shape), None)
    if match is None:
        o = Option(
            "recommended",
            largest,
            found.micro_batch,
            found.grad_accum,
            found.precision,
            found.checkpointing,
            packing,
        )
        row = measurer.measure(o)
        first = as_configurations([row])[0]
        row.update(compare_row(facts, case(first.options), first.measured, device))
        flatten_row(row)
        match = as_configurations([row])[0]
    rec["row"] = match.label
    rec["measured_status"] = match.status
    if match.status == "ok":
        m = match.measurement
        rec.update(
            tokens_per_s=m.tokens_per_s,
            step_s=m.projected_step_s,
            micro_step_s=m.micro_step_s,
            measured_peak_bytes=m.peak_total,
        )
    return rec


def _shape(o: SizingOptions) -> tuple[Any, ...]:
    """What a recommendation names of a configuration: length, micro-batch, checkpointing and
    precision."""
    return (o.seq_len, o.micro_batch, o.checkpointing, o.precision)


def _other_methods(
    measurer: _Measurer,
    template: Case,
    effective: int,
    budget: int,
    device: str,
    can_checkpoint: bool = True,
) -> list[dict[str, Any]]:
    """For each method measured beside the study's (`--methods`): its own recommendation at
    the longest length, so that a method that fits where the study's does not is proposed."""
    out = []
    for row in measurer.configurations():
        facts = measurer.facts_of.get(row.label or "")
        if facts is None:
            continue
        idle = row.measurement.idle_rss or 0
        rec = recommend(
            facts,
            template,
            effective_batch=effective,
            budget_bytes=budget,
            fixed_bytes=0 if device == "cuda" else idle,
            compare_total=device == "cuda",
            can_checkpoint=can_checkpoint,
        )
        keys = ("fits", "micro_batch", "grad_accum", "checkpointing", "predicted_peak_bytes")
        out.append({"method": row.method, **{k: rec.get(k) for k in keys}})
    return out


def _projection(
    facts: ModelFacts,
    template: Case,
    rec: SizingRecommendation,
    effective: int,
    ranks: tuple[int, ...],
) -> list[dict[str, Any]]:
    """Per-rank memory under DDP and FSDP over `ranks` processes, at the recommendation."""
    if not rec.fits or rec.micro_batch is None:
        return []
    per_rank = replace(template, micro_batch=rec.micro_batch, checkpointing=rec.checkpointing)
    projection = []
    for n in ranks:
        # the effective batch stays: each rank takes micro-batches of at most the recommended
        # size, the accumulation shrinks with the rank count
        micro = max(1, min(rec.micro_batch, effective // n))
        accum = max(1, -(-effective // (micro * n)))
        case = replace(per_rank, micro_batch=micro, grad_accum=accum)
        projection.append(
            {**project_per_rank(facts, case, n), "micro_batch": micro, "grad_accum": accum}
        )
    return projection


@dataclass
class _Setup:
    """What a sizing measures, decided before anything runs."""

    device: str
    lengths: dict[str, Any]  # the lengths record
    sizes: list[int]  # the sequence lengths measured
    peak_lengths: dict[str, Any]  # the lengths the peaks are found from
    options: list[Option]
    others: list[str]  # adaptation methods measured beside the study's
    effective: int
    budget: int
    loss_fraction: float
    can_checkpoint: bool
    base_spec: dict[str, Any]


def _setup(
    study: Study,
    seq_lens: list[int] | None,
    micro_batches: list[int] | None,
    precisions: list[str] | None,
    memory_budget: int | None,
    measure_steps: int,
    allocator: str,
    methods: list[str] | None,
) -> _Setup:
    """The lengths, the configurations and the child's base spec."""
    from tunelab.core.env import device_kind
    from tunelab.stages.train.precision import resolve_precision

    cfg = study.config
    device = device_kind()  # the steps run in child processes: no CUDA context here
    lengths, sizes, labels = study_lengths(study, seq_lens)
    peak_lengths = dict(lengths) if not seq_lens else snapshot_lengths(study, sizes)
    lengths.pop("order", None)
    can_checkpoint = supports_checkpointing(study)
    t = cfg.training
    effective = t.micro_batch_size * t.grad_accum_steps
    options = configurations(
        lengths=sizes,
        micro_batch=t.micro_batch_size,
        effective_batch=effective,
        precision=resolve_precision(t.precision, device),
        checkpointing=t.activation_checkpointing,
        packing=t.packing,
        micro_batches=micro_batches,
        precisions=[resolve_precision(p, device) for p in precisions or []],
        can_checkpoint=can_checkpoint,
    )
    budget = memory_budget or device_memory_bytes(device)
    loss_fraction = float(SizingLengths.of(WRITING, lengths, "lengths").loss_fraction or 1.0)
    base_spec = {
        "config": cfg.to_dict(),
        "root": str(study.root),
        "labels": labels,
        "loss_fraction": loss_fraction,
        "warmup_steps": 1,
        "measure_steps": measure_steps,
        "num_threads": t.num_threads,
        "device": device,
        "memory_budget_bytes": budget,
        "allocator": allocator,
    }
    others = [m for m in dict.fromkeys(methods or []) if m != cfg.adaptation.method]
    return _Setup(
        device, lengths, sizes, peak_lengths, options, others, effective, budget,
        loss_fraction, can_checkpoint, base_spec,
    )  # fmt: skip


def _measure_rows(
    study: Study,
    setup: _Setup,
    timeout_s: float,
    progress: Progress | None,
    shared: bool,
) -> tuple[_Measurer, list[Any], dict[Any, SizingConfiguration]]:
    """Every configuration, each other method and the peaks measured: (the measurer with the
    configurations' rows, the peaks' options, the peaks' rows by label)."""
    options, cfg = setup.options, study.config
    peaks = peak_options(cfg, model_architecture(study), options[0], setup.peak_lengths)
    # + the recommended configuration, when not measured yet
    total = len(options) + len(setup.others) + len(peaks) + 1
    own = own_label(setup.sizes[0])
    method = cfg.adaptation.method
    measurer = _Measurer(setup.base_spec, own, method, total, timeout_s, progress, shared)
    measurer.extras = {o.label: extra for o, extra, _ in peaks}
    queue = [(o, None) for o in options]
    queue += [(replace(options[0], label=f"method {m}"), m) for m in setup.others]
    queue += [(o, None) for o, _, _ in peaks]  # last: a peak over the budget ends its process
    planned = [o for o, _ in queue]
    note = sizing_forecast(study, planned, own, shared)
    if progress:
        progress("size", 0, total, f"{planned[0].label}; {note}")
    images = cfg.task.kind == "image_classification"
    on_row = RowProgress(planned, own, total, shared, progress, images)
    measurer.measure_all(queue, on_row)
    measured = measurer.configurations()
    peak_rows = {r.label: r for r in measured if r.label in measurer.extras}
    measurer.rows = [r.raw for r in measured if r.label not in measurer.extras]
    refuse_unmeasured(measurer.rows, measurer.facts)
    return measurer, peaks, peak_rows


def run(
    study: Study,
    *,
    seq_lens: list[int] | None = None,
    micro_batches: list[int] | None = None,
    precisions: list[str] | None = None,
    memory_budget: int | None = None,
    ranks: tuple[int, ...] = DEFAULT_RANKS,
    measure_steps: int = 1,
    allocator: str = "pinned",
    timeout_s: float = 1800.0,
    progress: Progress | None = None,
    methods: list[str] | None = None,
    shared: bool = True,
) -> tuple[dict[str, Any], Path]:
    """Measure, compare, recommend and record (see the module docstring).

    `methods`: adaptation methods (full, lora, qlora, freeze) measured besides the study's own,
    each one row at the study's own configuration, predicted from its own adapted model.
    `shared`: all configurations in one measuring process (False: a fresh one for each,
    `tunelab size --fresh-processes`; see `processes.measure_configurations`).

    `progress("size", done, total, label)` (core.progress) as the configurations are measured. Returns
    (record, path). Raises TunelabError when nothing could be measured or lengths are unknown;
    an out-of-memory configuration is a row with status does_not_fit.
    """
    from tunelab.stages.hypothesis.stage import require_hypothesis

    hypothesis = require_hypothesis(study.root, study.config)
    started = time.perf_counter()
    setup = _setup(
        study, seq_lens, micro_batches, precisions, memory_budget, measure_steps, allocator,
        methods,
    )  # fmt: skip
    measurer, peaks, peak_rows = _measure_rows(study, setup, timeout_s, progress, shared)
    record, template = _judge(study, hypothesis, setup, measurer, allocator, ranks)
    facts, rows, device = measurer.facts, measurer.configurations(), setup.device
    assert facts is not None
    idle = 0 if device == "cuda" else max(r.measurement.idle_rss or 0 for r in rows)
    worst, evaluation = peak_records(peaks, peak_rows, facts, template, device, idle)
    record.update(worst_batch_peak=worst, evaluation_peak=evaluation)
    # the load before the first step, and the evaluation on one device, for each layout
    record["load"] = load_table(facts, ranks, setup.budget, device, evaluation)
    record["seconds"] = round(time.perf_counter() - started, 3)
    record["processes"] = "shared" if shared and allocator == "pinned" else "fresh"
    return record, save_sizing(study, record)


def _judge(
    study: Study,
    hypothesis: dict[str, Any],
    setup: _Setup,
    measurer: _Measurer,
    allocator: str,
    ranks: tuple[int, ...],
) -> tuple[dict[str, Any], Case]:
    """Each row's prediction set beside its measurement, the recommendation, the other methods'
    and the per-rank projection: (the record, the case the recommendation was sized at)."""
    rows, facts, device = measurer.configurations(), measurer.facts, setup.device
    assert facts is not None
    t = study.config.training
    cuda_major = next((r.measurement.cuda_major for r in rows if r.measurement.cuda_major), 9)

    def case(opts: SizingOptions, accum: int | None = None) -> Case:
        return _case_of(
            opts, facts, t, loss_fraction=setup.loss_fraction, device=device,
            cuda_major=cuda_major, accum=accum,
        )  # fmt: skip

    for row in rows:
        own = measurer.facts_of.get(row.label or "", facts)
        row.raw.update(compare_row(own, case(row.options), row.measured, device))
        flatten_row(row.raw)
    # the recommendation, sized at the longest length with the study's precision and packing
    sizes, effective, budget = setup.sizes, setup.effective, setup.budget
    longest = replace(setup.options[0], seq_len=sizes[-1])
    template = case(SizingOptions.of(WRITING, longest.to_dict()), accum=1)
    template = replace(template, checkpointing=t.activation_checkpointing)
    rec = _recommendation(
        measurer, case, template, largest=sizes[-1], effective=effective, budget=budget,
        device=device, packing=t.packing, can_checkpoint=setup.can_checkpoint,
    )  # fmt: skip
    rec["other_methods"] = _other_methods(
        measurer, template, effective, budget, device, setup.can_checkpoint
    )
    recommended = SizingRecommendation.of(WRITING, rec, "recommendation")
    record = sizing_record(
        study, hypothesis, setup.lengths, sizes, device, budget, allocator, facts, measurer.rows,
        rec, _projection(facts, template, recommended, effective, ranks),
    )  # fmt: skip
    return record, template
