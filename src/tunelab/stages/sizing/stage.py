"""`tunelab size`: measure real steps of the study's model, set beside the analytic breakdown.

1. Representative lengths: the training split of the latest data snapshot goes through the
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
6. `records/sizing/<id>.json` (never overwritten), read by `tunelab plan`.

What is compared: on CUDA the predicted peak total against `max_memory_allocated`; on CPU the
predicted increase (optimizer states, gradients, activations, logits, temporaries) against the
measured peak RSS above the idle process (model, optimizer and batch loaded).

`run(..., methods=[...])` (`tunelab size --methods full,lora,qlora`) adds a row per other
method (`label` "method M") at the study's own configuration, each predicted from its own facts;
`recommendation.other_methods` [{method, fits, micro_batch, grad_accum, checkpointing,
predicted_peak_bytes}] (the CLI proposes one that fits when the study's does not). An image
model's "sequence length" is its patch tokens (`tunelab.lib.models.vision.patch_tokens`), or for
a conv net its square image side (`conv_image_side(base, cfg)`; the lengths record gains
`image_size` and `length_unit` "patch tokens" | "image side"); any other image model is refused
(ModelError); `supports_checkpointing(study)` drops the checkpointing configurations of a model
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
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.core.config_sections import CLASSIFYING_KINDS
from tunelab.core.config_training import TrainingConfig
from tunelab.core.errors import SnapshotError, StudyError
from tunelab.core.evidence import latest, sizing_dir
from tunelab.core.ledger import utc_now
from tunelab.core.progress import Progress
from tunelab.core.record_types import Sizing, Smoke
from tunelab.core.records import write_json_atomic
from tunelab.core.study import Study
from tunelab.stages.sizing.load import load_table
from tunelab.stages.sizing.memory import estimate_memory, project_per_rank
from tunelab.stages.sizing.peaks import peak_options, peak_records, refuse_unmeasured
from tunelab.stages.sizing.process_memory import MMAP_THRESHOLD
from tunelab.stages.sizing.processes import measure_configurations
from tunelab.stages.sizing.recommend import (
    Option,
    calibration,
    configurations,
    own_label,
    recommend,
)
from tunelab.stages.sizing.terms import Case, ModelFacts

# Timed steps of the study's own configuration, whose step time the planner multiplies by every
# step of every variant: the first steps after the heap is released still run slower, so it
# gets twice the other rows' 3.
PLANNED_TIME_STEPS = 6
DEFAULT_RANKS = (2, 4, 8)
# what a configuration costs besides its timed steps, in steps: the prime (a forward and
# backward that counts the saved activations too), the warm-up, the memory step (about two:
# every large allocation faults its pages in), the step that grows the heap and the forward
CONFIG_OVERHEAD_STEPS = 5.0
# a measuring process's start: Python, torch and transformers imported, the model loaded
PROCESS_START_S = 15.0
# each further configuration of a shared process: the model built again from the loaded files
CONFIG_BUILD_S = 2.0
# the timed part of a configuration besides its timed steps, in steps: the step that grows the
# heap and the forward timing
TIMING_OVERHEAD_STEPS = 2.0


def _step_of(o: Option, step_s: float, tokens_per_step: float, images: bool) -> float:
    """A step's time in proportion to its tokens (checkpointing recomputes a forward). An
    image step counts images, as its batches do: a configuration's `seq_len` is then the
    chain's patch tokens or side, the same for every configuration."""
    tokens = (1 if images else o.seq_len) * o.micro_batch * min(o.grad_accum, 2)
    return step_s * tokens / max(1.0, tokens_per_step) * (1.3 if o.checkpointing else 1.0)


def _timed(o: Option, own: str) -> int:
    return PLANNED_TIME_STEPS if o.label == own else 3


def expected_seconds(
    options: list[Option],
    own: str,
    step_s: float,
    tokens_per_step: float,
    start_s: float,
    build_s: float = CONFIG_BUILD_S,
    images: bool = False,
) -> float:
    """How long measuring `options` in one process takes, from a step of `step_s` seconds over
    `tokens_per_step` tokens: `start_s` for the process, `build_s` for each configuration after
    the first (`build_s=start_s`: a fresh process for each)."""
    total = start_s
    for i, o in enumerate(options):
        steps = CONFIG_OVERHEAD_STEPS + _timed(o, own)
        total += (build_s if i else 0.0) + _step_of(o, step_s, tokens_per_step, images) * steps
    return total


def timing_seconds(
    options: list[Option],
    own: str,
    step_s: float,
    tokens_per_step: float,
    build_s: float,
    images: bool = False,
) -> float:
    """How long the timed part of `options` takes once their memory is measured (a shared
    process): the model built again, the step that grows the heap, the timed steps, the
    forward."""
    return sum(
        build_s
        + _step_of(o, step_s, tokens_per_step, images) * (TIMING_OVERHEAD_STEPS + _timed(o, own))
        for o in options
    )


def _clock_text(seconds: float) -> str:
    return f"about {seconds / 60:.0f} min" if seconds >= 90 else f"about {seconds:.0f} s"


def _processes_text(count: int, shared: bool) -> str:
    where = "in one process" if shared else "each in its own process"
    return f"{count} configurations {where}"


def sizing_forecast(study: Study, options: list[Option], own: str, shared: bool = True) -> str:
    """A sentence saying how long the sizing will take, from the latest smoke's step time (the
    only step measured before), or that it is known after the first configuration."""
    found = latest(study, "smoke", "smoke.json")
    smoke, row = (Smoke.read(found.path), found.row) if found else (None, None)
    what = _processes_text(len(options), shared)
    if not smoke or not smoke.step_s or not smoke.tokens_per_step:
        return f"{what} (time known after the first)"
    start = smoke.fresh_process_s or PROCESS_START_S
    images = study.config.task.kind == "image_classification"
    seconds = expected_seconds(
        options, own, smoke.step_s, smoke.tokens_per_step, start,
        build_s=CONFIG_BUILD_S if shared else start, images=images,
    )  # fmt: skip
    unit = "images" if images else "tokens"
    return (
        f"{what}: {_clock_text(seconds)} "
        f"(smoke {row.id}: {smoke.step_s:.1f} s a step of {smoke.tokens_per_step:.0f} {unit})"
    )


def new_sizing_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"size-{stamp}-{secrets.token_hex(3)}"


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


def representative_lengths(study: Study, labels_out: list[Any] | None = None) -> dict[str, Any]:
    """Token counts of the training split after the study's preprocessing (latest snapshot)."""
    from tunelab.lib.models import load_tokenizer, resolve_base
    from tunelab.lib.preprocess.text import Preprocessor, length_stats
    from tunelab.lib.tasks import get_task
    from tunelab.stages.data import load_snapshot

    cfg = study.config
    try:
        snapshot = load_snapshot(study)
    except SnapshotError as exc:
        raise SnapshotError(
            f"no representative lengths: {exc.message}",
            hint="build the snapshot with `tunelab data`, or give lengths with --seq-len 256,512",
        ) from None
    base = resolve_base(study)
    task = get_task(cfg, snapshot.labels)
    if base.architecture == "image":
        return _image_lengths(base, snapshot, task, cfg)
    pre = Preprocessor(load_tokenizer(base), cfg, task, base.architecture)
    started = time.perf_counter()
    encoded = [pre.encode(r) for r in snapshot.rows("train")]
    encode_s = time.perf_counter() - started
    stats = length_stats(encoded)
    if not stats["n"]:
        raise SnapshotError(
            f"snapshot {snapshot.id} has no training examples",
            hint="check data.splits, then `tunelab data`",
        )
    counts = sorted(len(e["input_ids"]) for e in encoded)
    quantiles = [
        counts[min(len(counts) - 1, round(q * (len(counts) - 1) / 100))] for q in range(101)
    ]
    from tunelab.stages.sizing.peaks import evaluation_tokens

    evaluation = evaluation_tokens(pre, snapshot, cfg, base.architecture, counts[-1])
    positions = sum(max(0, len(e["input_ids"]) - 1) for e in encoded)
    loss = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in encoded if "labels" in e)
    return {
        "source": f"snapshot {snapshot.id}",
        "snapshot": snapshot.id,
        **stats,
        "loss_fraction": (loss / positions)
        if positions and base.architecture == "causal_lm"
        else 1.0,
        "labels": list(task.labels) if getattr(task, "labels", None) else None,
        "split_counts": dict(snapshot.manifest.get("counts", {}).get("final", {})),
        "encode_train_s": encode_s,
        "quantiles": quantiles,
        "evaluation_tokens": evaluation,
        # the training examples' lengths in snapshot order, for the worst batch (not recorded)
        "order": [len(e["input_ids"]) for e in encoded],
    }


def conv_image_side(base: Any, cfg: Any) -> int:
    """The side of the square images a conv net is fed in training: the study's image chain
    (`preprocess.image` over the base's processor), its center crop, else its fixed resize."""
    from tunelab.core.errors import ModelError
    from tunelab.lib.models.vision import load_image_processor
    from tunelab.lib.preprocess.images import resolve_chain

    chain = resolve_chain(load_image_processor(base), cfg)
    height, width = chain.crop or (
        (None, None) if chain.shortest_edge else (chain.height, chain.width)
    )
    if height is None or height != width:
        fed = "the shortest edge only" if height is None else f"{width}x{height}"
        raise ModelError(
            f"tunelab size walks a conv net at one square image side; the image chain feeds {fed}",
            hint="set preprocess.image.crop (or preprocess.image.resize) in study.yaml, so "
            "that every image reaches the model at one square size",
        )
    return int(height)


def _image_lengths(base: Any, snapshot: Any, task: Any, cfg: Any) -> dict[str, Any]:
    """An image model's "length": a ViT's patch tokens (at config.image_size), or a conv net's
    image side as the image chain feeds it (one size for all)."""
    from tunelab.core.errors import ModelError
    from tunelab.lib.models.vision import patch_tokens
    from tunelab.stages.sizing.terms import CONV_FAMILIES

    model_type = str(base.config.get("model_type", "")).lower()
    tokens, image_size = patch_tokens(base.config), base.config.get("image_size")
    if model_type in CONV_FAMILIES:  # ConvNeXt's config has a patch_size too (its stem's)
        tokens = image_size = conv_image_side(base, cfg)
    if tokens is None:
        raise ModelError(
            f"tunelab size models image transformers with patch tokens (ViT, DeiT) and the "
            f"conv nets {', '.join(CONV_FAMILIES)}; {model_type!r} is neither (no patch_size)",
            hint="the smoke's record (`tunelab smoke`) has this model's measured step time",
        )
    counts = dict(snapshot.manifest.get("counts", {}).get("final", {}))
    return {
        "source": f"snapshot {snapshot.id}",
        "snapshot": snapshot.id,
        "n": counts.get("train", 0),
        **{k: tokens for k in ("p50", "p95", "max", "mean")},
        "truncated": 0,
        "share_truncated": 0.0,
        "target_truncated": 0,
        "image_size": image_size,
        "length_unit": "image side" if model_type in CONV_FAMILIES else "patch tokens",
        "loss_fraction": 1.0,
        "labels": list(task.labels),
        "split_counts": counts,
        "encode_train_s": 0.0,
        "quantiles": [tokens] * 101,
        "evaluation_tokens": tokens,
        "order": [tokens] * int(counts.get("train", 0)),  # every image at one size
    }


def supports_checkpointing(study: Study) -> bool:
    """Whether the study's model can checkpoint activations: an image classifier's transformers
    class says (ResNet and ConvNeXt cannot); other models are taken to."""
    from tunelab.lib.models import resolve_base

    base = resolve_base(study)
    if base.architecture != "image":
        return True
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.get(str(base.config.get("model_type")))
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(cls, "supports_gradient_checkpointing", True))


def _labels(study: Study) -> list[str] | None:
    cfg = study.config
    if cfg.task.kind not in CLASSIFYING_KINDS:
        return None
    if cfg.task.labels:
        return list(cfg.task.labels)
    from tunelab.stages.data import load_snapshot

    try:
        return list(load_snapshot(study).labels or [])
    except SnapshotError:
        raise SnapshotError(
            "an encoder classifier needs its label set to be sized",
            hint="set task.labels in study.yaml or build the snapshot with `tunelab data`",
        ) from None


def _pct(pred: float | None, real: float | None) -> float | None:
    if not pred or not real:
        return None
    return round(100.0 * (pred - real) / real, 2)


def compare_row(
    facts: ModelFacts, case: Case, measured: dict[str, Any] | None, device: str
) -> dict[str, Any]:
    """Predicted breakdown, the measured figure it is compared with, error %, the x4 rule's."""
    est = estimate_memory(facts, case)
    cuda = device == "cuda"
    predicted = {**est.to_dict(), "compared": est.peak_total if cuda else est.peak_increase}
    # The rule says weights x 4 in all; over a process already holding the weights: x 3.
    rule = est.rule_x4 if cuda else est.rule_x4 - est.weights
    real = (measured or {}).get("peak_total" if cuda else "increase")
    out = {
        "predicted": predicted,
        "rule_x4": {"bytes": rule, "error_pct": _pct(rule, real)},
        "error_pct": _pct(predicted["compared"], real),
        "compared": "max_allocated" if cuda else "peak RSS - idle RSS",
    }
    if measured is not None:
        measured["compared"] = real
    return out


def _lengths(
    study: Study, seq_lens: list[int] | None
) -> tuple[dict[str, Any], list[int], list[str] | None]:
    """(lengths record, the sequence lengths to measure, the label set)."""
    if seq_lens:
        return {"source": "--seq-len", "loss_fraction": 1.0}, sorted(set(seq_lens)), _labels(study)
    lengths = representative_lengths(study)
    sizes = sorted({int(lengths["p95"]), int(lengths["max"])})
    return lengths, sizes, lengths.pop("labels")


class _Measurer:
    """Measures configurations (all in one process unless `shared` is off, see
    `processes.measure_configurations`); keeps the rows and the model facts the first
    successful one reports."""

    def __init__(
        self,
        base_spec: dict[str, Any],
        own: str,
        total: int,
        timeout_s: float,
        progress: Progress | None,
        shared: bool = True,
    ):
        self.base_spec, self.own, self.total = base_spec, own, total
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
            "grad_accum": min(o.grad_accum, 2),
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
        if result.get("facts") and method is not None:
            self.facts_of[o.label] = ModelFacts.from_dict(result["facts"])
        elif result.get("facts"):
            self.facts = self.facts or ModelFacts.from_dict(result["facts"])
        measured_accum = spec["grad_accum"]
        row: dict[str, Any] = {
            "label": o.label,
            "options": {**o.to_dict(), "measured_accum": measured_accum},
            "method": method or spec["config"]["adaptation"]["method"],
            "status": result.get("status"),
            "reason": result.get("reason"),
            "measured": result.get("measured"),
            "process": result.get("process"),
        }
        m = row["measured"]
        if m and m.get("step_s"):
            micro_s = m["step_s"] / measured_accum
            m["micro_step_s"] = micro_s
            m["projected_step_s"] = micro_s * o.grad_accum
        return row


def _remaining(
    done: list[tuple[Option, float]],
    left: list[Option],
    own: str,
    first: Any,
    shared: bool,
    images: bool,
) -> str:
    """How long the configurations `left` take, at the first measured step's time per token.
    Fresh processes: each as the measured ones took beyond their steps. One process: results
    come in once every memory is measured, so what is left is their timed part."""
    if not left or not first or not first.get("step_s") or not first.get("tokens_per_step"):
        return ""
    step_s, tokens = first["step_s"], first["tokens_per_step"]
    if shared:
        seconds = timing_seconds(left, own, step_s, tokens, CONFIG_BUILD_S, images)
        return f"{_clock_text(seconds)} left"
    costs = [
        max(0.0, s - expected_seconds([o], own, step_s, tokens, 0.0, images=images))
        for o, s in done
    ]
    start = sum(costs) / len(costs) if costs else PROCESS_START_S
    seconds = expected_seconds(left, own, step_s, tokens, start, start, images)
    return f"{_clock_text(seconds)} left"


def _case_of(
    opts: dict[str, Any],
    facts: ModelFacts,
    t: TrainingConfig,
    *,
    loss_fraction: float,
    device: str,
    cuda_major: int,
    accum: int | None = None,
) -> Case:
    """The analytic model's case for a row's options (the accumulation measured, or `accum`)."""
    return Case(
        seq_len=opts["seq_len"],
        micro_batch=opts["micro_batch"],
        grad_accum=accum or opts.get("measured_accum", opts["grad_accum"]),
        precision=opts["precision"],
        checkpointing=opts["checkpointing"],
        packing=bool(opts["packing"] and facts.architecture == "causal_lm"),
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
    facts, rows = measurer.facts, measurer.rows
    assert facts is not None
    ok = [r for r in rows if r["status"] == "ok"]
    idle = [r["measured"].get("idle_rss") for r in ok if r["measured"].get("idle_rss")]
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
    if not rec["fits"]:
        return rec
    match = next(
        (
            r
            for r in rows
            if r["options"]["seq_len"] == largest
            and r["options"]["micro_batch"] == rec["micro_batch"]
            and r["options"]["checkpointing"] == rec["checkpointing"]
            and r["options"]["precision"] == rec["precision"]
        ),
        None,
    )
    if match is None:
        o = Option(
            "recommended",
            largest,
            rec["micro_batch"],
            rec["grad_accum"],
            rec["precision"],
            rec["checkpointing"],
            packing,
        )
        match = measurer.measure(o)
        match.update(compare_row(facts, case(match["options"]), match["measured"], device))
        _flat(match)
    rec["row"] = match["label"]
    rec["measured_status"] = match["status"]
    if match["status"] == "ok":
        m = match["measured"]
        rec.update(
            tokens_per_s=m.get("tokens_per_s"),
            step_s=m.get("projected_step_s"),
            micro_step_s=m.get("micro_step_s"),
            measured_peak_bytes=m.get("peak_total"),
        )
    return rec


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
    for row in measurer.rows:
        facts = measurer.facts_of.get(row["label"])
        if facts is None:
            continue
        idle = (row["measured"] or {}).get("idle_rss") or 0
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
        out.append({"method": row["method"], **{k: rec.get(k) for k in keys}})
    return out


def _projection(
    facts: ModelFacts,
    template: Case,
    rec: dict[str, Any],
    effective: int,
    ranks: tuple[int, ...],
) -> list[dict[str, Any]]:
    """Per-rank memory under DDP and FSDP over `ranks` processes, at the recommendation."""
    if not rec.get("fits"):
        return []
    per_rank = replace(template, micro_batch=rec["micro_batch"], checkpointing=rec["checkpointing"])
    projection = []
    for n in ranks:
        # the effective batch stays: each rank takes micro-batches of at most the recommended
        # size, the accumulation shrinks with the rank count
        micro = max(1, min(rec["micro_batch"], effective // n))
        accum = max(1, -(-effective // (micro * n)))
        case = replace(per_rank, micro_batch=micro, grad_accum=accum)
        projection.append(
            {**project_per_rank(facts, case, n), "micro_batch": micro, "grad_accum": accum}
        )
    return projection


class _RowProgress:
    """The progress line once a configuration's result is in (in the order they end), with
    how long the rest will take."""

    def __init__(
        self,
        planned: list[Option],
        own: str,
        total: int,
        shared: bool,
        progress: Progress | None,
        images: bool = False,
    ):
        self.planned, self.own, self.total, self.shared = planned, own, total, shared
        self.images = images
        self.progress = progress
        self.done: list[tuple[Option, float]] = []
        self.timed: list[dict[str, Any]] = []
        self.finished: set[int] = set()
        self.clock = time.perf_counter()

    def __call__(self, i: int, row: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.done.append((self.planned[i], now - self.clock))
        self.clock = now
        if (row.get("measured") or {}).get("step_s"):
            self.timed.append(row["measured"])
        self.finished.add(i)
        left = [o for j, o in enumerate(self.planned) if j not in self.finished]
        if self.progress and left:
            first = self.timed[0] if self.timed else None
            note = _remaining(self.done, left, self.own, first, self.shared, self.images)
            n = len(self.done)
            self.progress("size", n, self.total, f"{n} of {len(self.planned)} measured; {note}")


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
    from tunelab.core.env import device_kind
    from tunelab.stages.hypothesis.stage import require_hypothesis
    from tunelab.stages.train.precision import resolve_precision

    cfg = study.config
    hypothesis = require_hypothesis(study.root, cfg)
    started = time.perf_counter()
    device = device_kind()  # the steps run in child processes: no CUDA context here
    lengths, sizes, labels = _lengths(study, seq_lens)
    peak_lengths = dict(lengths) if not seq_lens else _snapshot_lengths(study, sizes)
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
    loss_fraction = float(lengths.get("loss_fraction") or 1.0)
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
    # + the recommended configuration, when not measured yet
    others = [m for m in dict.fromkeys(methods or []) if m != cfg.adaptation.method]
    peaks = peak_options(cfg, _architecture(study), options[0], peak_lengths)
    total = len(options) + len(others) + len(peaks) + 1
    own = own_label(sizes[0])
    measurer = _Measurer(base_spec, own, total, timeout_s, progress, shared)
    measurer.extras = {o.label: extra for o, extra, _ in peaks}
    queue = [(o, None) for o in options]
    queue += [(replace(options[0], label=f"method {m}"), m) for m in others]
    queue += [(o, None) for o, _, _ in peaks]  # last: a peak over the budget ends its process
    planned = [o for o, _ in queue]
    note = sizing_forecast(study, planned, own, shared)
    if progress:
        progress("size", 0, total, f"{planned[0].label}; {note}")
    images = cfg.task.kind == "image_classification"
    on_row = _RowProgress(planned, own, total, shared, progress, images)
    measurer.measure_all(queue, on_row)
    peak_rows = {r["label"]: r for r in measurer.rows if r["label"] in measurer.extras}
    measurer.rows = [r for r in measurer.rows if r["label"] not in measurer.extras]
    rows, facts = measurer.rows, measurer.facts
    refuse_unmeasured(rows, facts)
    assert facts is not None
    cuda_major = next(
        (r["measured"]["cuda_major"] for r in rows if (r["measured"] or {}).get("cuda_major")), 9
    )

    def case(opts: dict[str, Any], accum: int | None = None) -> Case:
        return _case_of(
            opts, facts, t, loss_fraction=loss_fraction, device=device, cuda_major=cuda_major,
            accum=accum,
        )  # fmt: skip

    for row in rows:
        own = measurer.facts_of.get(row["label"], facts)
        row.update(compare_row(own, case(row["options"]), row["measured"], device))
        _flat(row)
    # the recommendation, sized at the longest length with the study's precision and packing
    template = case({**options[0].to_dict(), "seq_len": sizes[-1]}, accum=1)
    template = replace(template, checkpointing=t.activation_checkpointing)
    rec = _recommendation(
        measurer, case, template, largest=sizes[-1], effective=effective, budget=budget,
        device=device, packing=t.packing, can_checkpoint=can_checkpoint,
    )  # fmt: skip
    rec["other_methods"] = _other_methods(
        measurer, template, effective, budget, device, can_checkpoint
    )
    record = _record(
        study, hypothesis, lengths, sizes, device, budget, allocator, facts, rows, rec,
        _projection(facts, template, rec, effective, ranks),
    )  # fmt: skip
    idle = 0 if device == "cuda" else max((r["measured"] or {}).get("idle_rss") or 0 for r in rows)
    record.update(peak_records(peaks, peak_rows, facts, template, device, idle))
    record["load"] = load_table(facts, ranks, budget, device)  # the load before the first step
    record["seconds"] = round(time.perf_counter() - started, 3)
    record["processes"] = "shared" if shared and allocator == "pinned" else "fresh"
    return record, _save(study, record)


def _architecture(study: Study) -> str:
    from tunelab.lib.models import resolve_base

    return resolve_base(study).architecture


def _snapshot_lengths(study: Study, sizes: list[int]) -> dict[str, Any]:
    """With --seq-len: the snapshot's lengths for the peaks where there is a snapshot, else
    none for the worst batch and the longest given length for the evaluation."""
    try:
        return representative_lengths(study)
    except SnapshotError:
        return {"evaluation_tokens": sizes[-1]}


def _save(study: Study, record: dict[str, Any]) -> Path:
    """records/sizing/<id>.json, and its event in the ledger."""
    path = write_json_atomic(sizing_dir(study) / f"{record['id']}.json", record)
    keys = ("id", "max_error_pct", "seconds")
    study.ledger.add_event(None, "sizing:recorded", {k: record[k] for k in keys})
    return path


def _record(
    study: Study,
    hypothesis: dict[str, Any],
    lengths: dict[str, Any],
    sizes: list[int],
    device: str,
    budget: int,
    allocator: str,
    facts: ModelFacts,
    rows: list[dict[str, Any]],
    rec: dict[str, Any],
    projection: list[dict[str, Any]],
) -> dict[str, Any]:
    """records/sizing/<id>.json (its `seconds` filled in by the caller)."""
    from tunelab.core.env import capture_env

    cfg = study.config
    t = cfg.training
    effective = t.micro_batch_size * t.grad_accum_steps
    throughput = _throughput(rows, rec, sizes)
    return {
        "id": new_sizing_id(),
        "kind": "sizing",
        "created_at": utc_now(),
        "seconds": None,
        "config_sha256": cfg.sha256(),
        "hypothesis_version": hypothesis["version"],
        "hypothesis_sha256": hypothesis["sha256"],
        "data_snapshot": lengths.get("snapshot"),
        "device": device,
        "env": _env_summary(capture_env()),
        "model": {"path": cfg.model.path, "architecture": facts.architecture},
        "adaptation": cfg.adaptation.model_dump(mode="json"),
        "training": {
            "micro_batch_size": t.micro_batch_size,
            "grad_accum_steps": t.grad_accum_steps,
            "effective_batch": effective,
            "precision": t.precision,
            "activation_checkpointing": t.activation_checkpointing,
            "packing": t.packing,
            "optimizer": t.optimizer,
        },
        "lengths": lengths,
        "seq_lens": sizes,
        "memory_budget_bytes": budget,
        "processes": None,
        "allocator": (
            f"glibc mmap threshold pinned at {MMAP_THRESHOLD} bytes in the measuring process"
            if allocator == "pinned"
            else "default"
        ),
        "facts": facts.to_dict(),
        "configurations": rows,
        "max_error_pct": _max_abs(r.get("error_pct") for r in rows),
        "rule_x4_max_error_pct": _max_abs(r["rule_x4"]["error_pct"] for r in rows),
        "recommendation": rec,
        "projection": projection,
        "throughput": throughput,
        "step_s": throughput.get("step_s"),
        "tokens_per_s": throughput.get("tokens_per_s"),
    }


def _flat(row: dict[str, Any]) -> None:
    """Flat copies of the figures a table shows (the report reads them)."""
    m = row.get("measured") or {}
    row.update(
        seq_len=row["options"]["seq_len"],
        micro_batch=row["options"]["micro_batch"],
        predicted_mb=round(row["predicted"]["compared"] / 2**20, 2),
        measured_mb=round(m["compared"] / 2**20, 2) if m.get("compared") else None,
        step_s=m.get("projected_step_s"),
    )


def _throughput(
    rows: list[dict[str, Any]], rec: dict[str, Any], sizes: list[int]
) -> dict[str, Any]:
    """The step time and tokens/s the planner uses: the study's own configuration at the most
    typical length measured (the first), and the recommended one's when it was measured."""
    own = next((r for r in rows if r["label"] == own_label(sizes[0])), None)
    out: dict[str, Any] = {}
    if own and own["status"] == "ok":
        m = own["measured"]
        out = {
            "row": own["label"],
            "seq_len": own["options"]["seq_len"],
            "step_s": m.get("projected_step_s"),
            "micro_step_s": m.get("micro_step_s"),
            "tokens_per_s": m.get("tokens_per_s"),
            "examples_per_s": m.get("examples_per_s"),
        }
    if rec.get("tokens_per_s"):
        out["recommended_tokens_per_s"] = rec["tokens_per_s"]
    return out


def _max_abs(values: Any) -> float | None:
    """The error of largest magnitude, with its sign."""
    found = [v for v in values if v is not None]
    return round(max(found, key=abs), 2) if found else None


def _env_summary(env: dict[str, Any]) -> dict[str, Any]:
    return {
        "torch": env.get("torch"),
        "backend": env.get("backend"),
        "cpu": env.get("cpu"),
        "gpus": env.get("gpus"),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "packages": env.get("packages"),
    }


def require_sizing(study: Study) -> Sizing:
    """The latest sizing record, read as its kind (`core.record_types.Sizing`)."""
    found = latest(study, "sizing")
    if found is None:
        raise StudyError(
            "no sizing record in records/sizing/", hint="measure the step first: `tunelab size`"
        )
    return Sizing.read(found.path)
