"""A study projected onto a catalog GPU before renting it: memory, micro-batch, step time, and
the evaluation, from the study's own shapes.

- The model: the sizing's facts (read from the adapted model), else its config.json and the
  registered adaptation (`shapes.facts_from_config`).
- The data: the snapshot's split counts; token lengths and the loss share from the sizing's
  length distribution, packed or padded as training batches them.
- Memory: the sizing's analytic model (`sizing.memory`) at the rental precision, and its
  recommendation: the largest micro-batch whose accumulation keeps the effective batch and that
  fits the GPU with the sizing's safety margin and the CUDA context.
- Time: a micro-step takes its FLOPs (`flops`) over peak x utilization, or the host's time to
  issue its kernels when that is longer (a small model); the optimizer step reads and writes
  the trainable parameters and their states at memory bandwidth; DDP and FSDP add their
  collectives at the interconnect's speed, not overlapped (an upper bound).
- Evaluation: prefill FLOPs, then one decoding step per generated token bound by the bytes of
  weights and KV cache read, or by the host; a classifier's forward passes.

The utilization is stated, never hidden: the catalog's default for the GPU's architecture and
the method, the study's own measured step on a GPU of the same architecture when it has one
(a sizing or a training run on CUDA), or the user's `--utilization`.

Interface: `project(shape, cfg, gpu, gpus=, strategy=, utilization=, measured=) -> Projection`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.errors import ConfigError, StudyError
from tunelab.core.record_plan import FitCandidate
from tunelab.core.record_sizing import (
    SizingRecommendation,
    env_of,
    options_of,
    throughput_of,
)
from tunelab.core.record_types import Sizing
from tunelab.core.run_parts import Gpu as SeenGpu
from tunelab.stages.plan.catalog import Gpu, UtilizationRange, default_utilization, gpu_of_device
from tunelab.stages.plan.catalog import host_cost as catalog_host
from tunelab.stages.plan.figures import SplitCounts, expected_max
from tunelab.stages.plan.flops import MicroBatch, forward_flops, kv_cache_bytes, micro_step_flops
from tunelab.stages.sizing.terms import DTYPE_BYTES, Case, ModelFacts

CUDA_CONTEXT_BYTES = 1 << 30  # the CUDA context and allocator slack the memory model leaves out
MEMORY_BANDWIDTH_SHARE = 0.7  # of the datasheet bandwidth, for streaming reads and writes
MEASURED_SPREAD = 0.10  # the range around a measured utilization
STRATEGIES = ("ddp", "fsdp")
# where a projection's recommendation would be named if it were damaged: it is never written
RECOMMENDED = "the projection's recommendation (stages.sizing.recommend)"


@dataclass(frozen=True)
class StudyShape:
    """What the projection reads of the study, each part with its source."""

    facts: ModelFacts
    facts_source: str
    quantiles: tuple[float, ...]  # training lengths at evenly spaced ranks (empty: all max_len)
    mean_len: float
    max_len: int
    lengths_source: str
    loss_fraction: float
    loss_source: str
    packing: bool
    counts: SplitCounts
    generating: bool
    candidates: int  # forwards per evaluated example (a causal classifier scores each label)
    eval_batch: int
    prompt_len: float
    answer_steps: float  # decoding steps of one evaluation batch
    generation_source: str
    precision: str  # the rental's training precision
    precision_source: str


@dataclass(frozen=True)
class Fit:
    """The micro-batch chosen for the GPU, per rank."""

    fits: bool
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    peak_bytes: int
    budget_bytes: int
    reason: str | None = None
    load: dict[str, Any] | None = None  # the load-time peak (tunelab.stages.sizing.load)


@dataclass(frozen=True)
class StepTime:
    value: float
    low: float
    high: float
    bound: str  # "compute" | "host"
    flops: float  # per optimizer step, one rank
    tokens: float  # per optimizer step, all ranks
    optimizer_s: float
    communication_s: float


@dataclass(frozen=True)
class Input:
    """One input of the projection: what it is, where it came from, and its `kind`: measured
    (a record of this study), read (its files), datasheet, given (a flag) or assumed."""

    name: str
    value: str
    source: str
    kind: str


@dataclass
class Projection:
    gpu: str
    gpu_name: str
    gpus: int
    strategy: str
    precision: str
    fit: Fit
    step: StepTime
    utilization: UtilizationRange
    utilization_measured: bool
    eval_s_per_example: float
    forward_s: float
    inputs: list[Input] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ tokens of a batch


def _mean_of(shape: StudyShape, f: Any) -> float:
    """E[f(length)] over the training lengths."""
    if not shape.quantiles:
        return float(f(shape.max_len))
    return sum(f(q) for q in shape.quantiles) / len(shape.quantiles)


def micro_batch(shape: StudyShape, m: int) -> MicroBatch:
    """One training micro-batch of m examples: packed rows keep each example's own attention;
    padded rows are as long as their longest example."""
    causal = shape.facts.architecture == "causal_lm"
    if shape.packing:
        tokens = m * shape.mean_len
        pairs = m * _mean_of(shape, lambda n: n * (n + 1) / 2)
    else:
        padded = expected_max(list(shape.quantiles), m) if shape.quantiles else shape.max_len
        tokens = m * padded
        pairs = m * (padded * (padded + 1) / 2 if causal else padded**2)
    head = m * shape.mean_len * shape.loss_fraction if causal else m
    return MicroBatch(tokens=tokens, attention_pairs=pairs, head_tokens=head, examples=m)


# ------------------------------------------------------------------ memory


def choose_fit(shape: StudyShape, cfg: StudyConfig, gpu: Gpu, gpus: int, strategy: str) -> Fit:
    """The largest micro-batch (per rank) whose accumulation keeps the study's effective batch
    and that fits `gpu` (the sizing's recommendation at the rental precision)."""
    from tunelab.stages.sizing.load import load_peak, load_problem, strategy_refusal
    from tunelab.stages.sizing.peaks import plan_peak
    from tunelab.stages.sizing.recommend import recommend

    t = cfg.training
    effective = t.micro_batch_size * t.grad_accum_steps
    if effective % gpus:
        raise ConfigError(
            f"--gpus {gpus}: the effective batch of {effective} examples "
            f"(micro_batch_size x grad_accum_steps) does not divide among {gpus} GPUs",
            hint="choose --gpus dividing it, or set training.grad_accum_steps so that it does",
        )
    template = Case(
        seq_len=shape.max_len,
        micro_batch=1,
        precision=shape.precision,
        checkpointing=t.activation_checkpointing,
        packing=shape.packing,
        masked=not shape.packing,
        loss_fraction=shape.loss_fraction,
        optimizer=t.optimizer,
        device="cuda",
        cuda_major=9 if gpu.arch == "hopper" else 8,
    )
    layout = "single" if gpus == 1 else strategy
    load = load_peak(shape.facts, layout, gpus, gpus, "cuda")
    problem = strategy_refusal(shape.facts, layout, shape.precision) or load_problem(
        load, gpu.memory_bytes - CUDA_CONTEXT_BYTES, None
    )
    if problem is not None:  # the run would be refused, or die before its first step
        return Fit(False, 1, effective // gpus, t.activation_checkpointing,
                   load.device_per_rank + CUDA_CONTEXT_BYTES, gpu.memory_bytes, problem,
                   load.to_dict())  # fmt: skip
    found = SizingRecommendation.of(RECOMMENDED, recommend(
        shape.facts,
        template,
        effective_batch=effective // gpus,
        budget_bytes=gpu.memory_bytes,
        fixed_bytes=CUDA_CONTEXT_BYTES,
        compare_total=True,
        strategy="single" if gpus == 1 else strategy,
        ranks=gpus,
    ), "recommendation")  # fmt: skip
    if found.fits:  # one card: the larger of the training and evaluation peaks
        peak, over = plan_peak(found.predicted_peak_bytes, shape.facts, cfg, shape.max_len,
                               shape.precision, gpu.memory_bytes, CUDA_CONTEXT_BYTES, gpus)  # fmt: skip
        return Fit(
            over is None,
            found.micro_batch,
            found.grad_accum,
            found.checkpointing,
            peak,
            gpu.memory_bytes,
            over,
            load=load.to_dict(),
        )
    tried = found.parts(FitCandidate, "candidates")
    smallest = min(tried, key=lambda c: c.predicted_peak_bytes)
    # the weights alone (every expert of an MoE model resident) over the card: say that first
    weights = shape.facts.total_weight_bytes / (gpus if gpus > 1 and strategy == "fsdp" else 1)
    reason = f"weights {weights / 1e9:.1f} GB" if weights > gpu.memory_bytes else found.reason
    return Fit(
        False,
        smallest.micro_batch,
        smallest.grad_accum,
        smallest.checkpointing,
        smallest.predicted_peak_bytes,
        gpu.memory_bytes,
        reason,
        load.to_dict(),
    )


# ------------------------------------------------------------------ time


def step_time(
    shape: StudyShape, fit: Fit, gpu: Gpu, util: UtilizationRange, gpus: int, strategy: str
) -> StepTime:
    """One optimizer step on one rank of `gpus` (see the module docstring)."""
    facts = shape.facts
    batch = micro_batch(shape, fit.micro_batch)
    flops = micro_step_flops(facts, batch, checkpointing=fit.checkpointing)
    peak = gpu.peak_flops(shape.precision)
    passes = 1 + (1 if flops.backward else 0) + (1 if flops.recompute else 0)
    host = facts.layers * passes * catalog_host().train_block_pass_s
    optimizer = 7 * facts.trainable_bytes / (gpu.bandwidth * MEMORY_BANDWIDTH_SHARE)
    comm = _communication_s(facts, gpu, gpus, strategy, fit.grad_accum)

    def step(u: float) -> float:
        return fit.grad_accum * max(flops.total / (peak * u), host) + optimizer + comm

    bound = "host" if host >= flops.total / (peak * util.value) else "compute"
    return StepTime(
        value=step(util.value),
        low=step(util.high),
        high=step(util.low),
        bound=bound,
        flops=fit.grad_accum * flops.total,
        tokens=fit.grad_accum * batch.tokens * gpus,
        optimizer_s=optimizer,
        communication_s=comm,
    )


def _communication_s(facts: ModelFacts, gpu: Gpu, gpus: int, strategy: str, accum: int) -> float:
    """A ring all-reduce of the gradients once a step (DDP), or per micro-step the weights
    gathered for forward and backward and the gradients reduce-scattered (FSDP)."""
    if gpus <= 1:
        return 0.0
    one_way = gpu.interconnect_gbs * 1e9 / 2
    share = (gpus - 1) / gpus
    if strategy == "fsdp":
        return accum * (2 * facts.total_weight_bytes + facts.trainable_bytes) * share / one_way
    return 2 * share * facts.trainable_bytes / one_way


def eval_seconds_per_example(shape: StudyShape, gpu: Gpu, util: UtilizationRange) -> float:
    """One evaluated example: a share of its batch's forward passes, or of its batch's prefill
    and decoding steps. Evaluation runs in the model's dtype (no autocast)."""
    facts = shape.facts
    compute_bytes = DTYPE_BYTES.get(facts.param_dtype, 4)
    precision = {2: "bf16"}.get(compute_bytes, "fp32")
    peak = gpu.peak_flops(precision) * util.value
    host = facts.layers * catalog_host().infer_block_s
    b = max(1, shape.eval_batch)
    if not shape.generating:
        batch = micro_batch(replace(shape, loss_fraction=0.0), b)
        batch = replace(batch, head_tokens=b)
        one = max(forward_flops(facts, batch) / peak, host)
        return shape.candidates * one / b
    prompt = shape.prompt_len
    prefill = MicroBatch(b * prompt, b * prompt * (prompt + 1) / 2, b, b)
    prefill_s = max(forward_flops(facts, prefill) / peak, host)
    context = prompt + shape.answer_steps / 2
    step_bytes = facts.total_weight_bytes + kv_cache_bytes(facts, b, context, compute_bytes)
    decode = MicroBatch(b, b * context, b, b)
    step_s = max(
        step_bytes / (gpu.bandwidth * MEMORY_BANDWIDTH_SHARE),
        forward_flops(facts, decode) / peak,
        host,
    )
    return (prefill_s + max(0.0, shape.answer_steps - 1) * step_s) / b


def validation_forward_s(
    shape: StudyShape, cfg: StudyConfig, gpu: Gpu, util: UtilizationRange
) -> float:
    """One validation forward of a training micro-batch (the study's micro_batch_size)."""
    batch = micro_batch(shape, cfg.training.micro_batch_size)
    peak = gpu.peak_flops(shape.precision) * util.value
    host = shape.facts.layers * catalog_host().train_block_pass_s
    return max(forward_flops(shape.facts, batch) / peak, host)


# ------------------------------------------------------------------ utilization


def _measured_step_flops(
    shape: StudyShape, micro: int, accum: int, seq_len: int, ckpt: bool
) -> float:
    """FLOPs of a measured step of equal-length examples (as the sizing times them)."""
    causal = shape.facts.architecture == "causal_lm"
    pairs = micro * (seq_len * (seq_len + 1) / 2 if causal else seq_len**2)
    head = micro * (seq_len - 1) * shape.loss_fraction if causal else micro
    batch = MicroBatch(micro * seq_len, pairs, head, micro)
    return accum * micro_step_flops(shape.facts, batch, checkpointing=ckpt).total


def measured_utilization(sizing: Sizing | None, shape: StudyShape) -> tuple[float, Gpu, str] | None:
    """The study's own step measured on a catalog GPU, as a share of its peak: (share, GPU,
    where it came from), or None when the study has no sizing measured on CUDA."""
    if sizing is None or sizing.device != "cuda":
        return None
    names = [g.name for g in env_of(sizing).parts(SeenGpu, "gpus")]
    gpu = gpu_of_device(names[0] if names else None)
    thr = throughput_of(sizing)
    row = next((r for r in sizing.rows if r.label == thr.row), None)
    if gpu is None or row is None or row.status != "ok" or not thr.step_s:
        return None
    o = options_of(row)
    flops = _measured_step_flops(
        shape,
        o.micro_batch,
        o.measured_accum or o.grad_accum or 1,
        o.seq_len,
        bool(o.checkpointing),
    )
    share = flops / (thr.step_s * gpu.peak_flops(o.precision or shape.precision))
    return share, gpu, f"sizing {sizing.id} on {names[0]}: {thr.step_s:.3f} s a step"


def resolve_utilization(
    gpu: Gpu, method: str, given: float | None, measured: tuple[float, Gpu, str] | None
) -> tuple[UtilizationRange, bool, list[str]]:
    """(the utilization, whether it was measured, notes): --utilization, else the study's own
    measurement on a GPU of the same architecture, else the catalog's default."""
    notes: list[str] = []
    if given is not None:
        if not 0 < given <= 1:
            raise ConfigError(
                f"--utilization {given:g} is not a share of the peak",
                hint="e.g. --utilization 0.35",
            )
        return UtilizationRange(given, given, given, "given: --utilization"), False, notes
    if measured is not None:
        share, on, source = measured
        if on.arch == gpu.arch:
            lo, hi = share * (1 - MEASURED_SPREAD), min(1.0, share * (1 + MEASURED_SPREAD))
            return UtilizationRange(lo, share, hi, f"measured: {source}"), True, notes
        notes.append(
            f"the study's step measured on {on.name} ({100 * share:.0f} % of its peak) is not "
            f"applied to {gpu.name} (another architecture): the catalog's default is"
        )
    return default_utilization(gpu.arch, method), False, notes


def experts_placement(shape: StudyShape, gpus: int, strategy: str) -> str | None:
    """Where a mixture of experts' experts lie on a layout (None for a dense model). FSDP
    shards each parameter on its first dimension, and transformers keeps a layer's experts in
    one tensor [experts, ...]: each GPU holds its share of whole experts at rest."""
    moe = shape.facts.moe
    if not moe:
        return None
    experts = int(moe["experts"])
    if gpus > 1 and strategy == "fsdp":
        return f"{-(-experts // gpus)} of {experts} experts a layer on each GPU (FSDP)"
    return f"all {experts} experts on " + ("every GPU" if gpus > 1 else "the GPU")


def check_layout(gpus: int, strategy: str) -> None:
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: at least one GPU", hint="e.g. --gpus 2")
    if strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {strategy!r}", hint="--strategy ddp|fsdp")


def project(
    shape: StudyShape,
    cfg: StudyConfig,
    gpu: Gpu,
    *,
    gpus: int = 1,
    strategy: str = "ddp",
    utilization: float | None = None,
    measured: tuple[float, Gpu, str] | None = None,
) -> Projection:
    """The study on `gpus` x `gpu`: its micro-batch, step time (with its range) and evaluation."""
    check_layout(gpus, strategy)
    util, was_measured, notes = resolve_utilization(
        gpu, cfg.adaptation.method, utilization, measured
    )
    fit = choose_fit(shape, cfg, gpu, gpus, strategy)
    step = step_time(shape, fit, gpu, util, gpus, strategy)
    if not fit.fits:
        load = (fit.reason or "").startswith("the load does not fit")
        notes.append(fit.reason if load else f"does not fit: {fit.reason}")
    if step.bound == "host":
        notes.append(
            "the step is bound by the host issuing kernels (a small model): a faster GPU does "
            "not shorten it"
        )
    return Projection(
        gpu=gpu.id,
        gpu_name=gpu.name,
        gpus=gpus,
        strategy="single" if gpus == 1 else strategy,
        precision=shape.precision,
        fit=fit,
        step=step,
        utilization=util,
        utilization_measured=was_measured,
        eval_s_per_example=eval_seconds_per_example(shape, gpu, util),
        forward_s=validation_forward_s(shape, cfg, gpu, util),
        inputs=_inputs(shape, gpu, util),
        notes=notes,
    )


def _kind(source: str) -> str:
    if source.startswith(("sizing", "baseline", "measured")):
        return "measured"
    return "given" if source.startswith("given") else "assumed"


def _inputs(shape: StudyShape, gpu: Gpu, util: UtilizationRange) -> list[Input]:
    host = catalog_host()
    f = shape.facts
    peak = gpu.peak_flops(shape.precision) / 1e12
    if shape.generating:
        evaluation = (
            f"{shape.eval_batch} a batch, prompts of {shape.prompt_len:.0f} tokens, "
            f"{shape.answer_steps:.0f} decoding steps"
        )
    else:
        evaluation = f"{shape.eval_batch} a batch, {shape.candidates} forward(s) an example"
    packed = " (packed)" if shape.packing else " (padded)"
    return [
        Input(
            "GPU",
            f"{peak:g} TFLOP/s {shape.precision}, {gpu.memory_gb:g} GB, {gpu.bandwidth_gbs:g} GB/s",
            f"{gpu.source}: {gpu.url}",
            "datasheet",
        ),
        Input(
            "model",
            f"{f.num_params:,} parameters, {f.trainable_params:,} trained, {f.layers} blocks"
            + (
                f"; mixture of experts: {f.moe['active_params']:,} active a token "
                f"({f.moe['top_k']} of {f.moe['experts']} experts)"
                if f.moe
                else ""
            ),
            shape.facts_source,
            "measured" if shape.facts_source.startswith("sizing") else "read",
        ),
        Input(
            "lengths",
            f"images of {shape.max_len} px a side"
            if f.conv
            else f"{shape.max_len} patch tokens an image"
            if f.architecture == "image"
            else f"mean {shape.mean_len:.0f}, longest {shape.max_len} tokens{packed}",
            shape.lengths_source,
            _kind(shape.lengths_source),
        ),
        Input(
            "loss share",
            f"{100 * shape.loss_fraction:.0f} % of positions",
            shape.loss_source,
            _kind(shape.loss_source),
        ),
        Input(
            "examples",
            f"{shape.counts.train} train, {shape.counts.validation} validation, "
            f"{shape.counts.test} test",
            "the data snapshot",
            "read",
        ),
        Input("precision", shape.precision, shape.precision_source, "assumed"),
        Input(
            "utilization",
            f"{util.value:.2f} ({util.low:.2f}-{util.high:.2f})",
            util.source,
            _kind(util.source),
        ),
        Input(
            "host per block",
            f"{1000 * host.train_block_pass_s:.1f} ms a pass (training), "
            f"{1000 * host.infer_block_s:.1f} ms (inference)",
            f"{host.train_source}; {host.infer_source}",
            "assumed",
        ),
        Input("evaluation", evaluation, shape.generation_source, _kind(shape.generation_source)),
    ]


def rows_needed(shape: StudyShape) -> None:
    if not (shape.counts.train or shape.counts.validation):
        raise StudyError(
            "no data snapshot to plan from", hint="run `tunelab data` first (it needs no model)"
        )
