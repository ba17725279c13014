"""`tunelab plan`: a rental plan built from measured figures, and its review against the ledger.

The figures (each kept with where it came from):
- step time and throughput, model load time, validation forward time: the latest sizing record
  (`tunelab size`), scaled from the measured length to the data's own token counts;
- generation evaluation time per example, checkpoint save time, fresh-process reload time:
  the latest smoke record (`tunelab smoke`), else the baseline's evaluation;
- the durations of smoke, sizing and baseline themselves, from the ledger and the records.

The plan (`build_plan`, pure) lays out the phases of a rental: initial check (environment,
smoke, sizing, baseline), experiments (each variant's training run as the ledger times it:
tokenization, model load, steps, validation losses, checkpoint saves), evaluation (each
variant's validation evaluation, a fresh-process verification, the one final test), a
resumption margin (one interruption per variant: the lost half checkpoint interval, a restart,
and a checkpoint re-inspected in a new process), and export. Each phase carries an explicit
margin. It says how many variants fit the rental window and warns when the registered number
does not, gives the cost, and draws a Gantt chart.

The figures are those of the machine that measured them: planned on CPU, the plan is for this
CPU. `speedup` (compute x times faster on the rented GPU) or `step_time_s` project it there.

`review_plan` sets the planned durations against the actual ones of the ledger (created_at ->
finished_at of each run, the records' own durations), phase by phase, for the units that ran.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.env import BUSY_CPU_SHARE
from tunelab.errors import StudyError
from tunelab.ledger import utc_now
from tunelab.records import read_json, write_bytes_atomic, write_json_atomic
from tunelab.study import Study

PHASES = ("initial check", "experiments", "evaluation", "resumption margin", "export")
# Margin added to each phase for run-to-run variation (the resumption phase is itself a margin).
MARGINS = {
    "initial check": 0.10,
    "experiments": 0.15,
    "evaluation": 0.10,
    "resumption margin": 0.0,
    "export": 0.25,
}
ENV_CHECK_S = 5.0
PROCESS_START_S = 3.0  # a new Python process importing torch (when no smoke measured one)
EXPORT_FIXED_S = 0.05  # records read, the comparison, manifest and model card written
DEFAULT_EVAL_S_PER_EXAMPLE = None
# A phase planned and measured under this many seconds is shown in the review but left out of
# its largest error: a process's timing varies by tenths of a second on a shared machine, and
# such a phase weighs nothing in a rental counted in hours.
RESOLUTION_S = 1.0


# ------------------------------------------------------------------ figures


@dataclass
class Figure:
    value: float | None
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


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


def _latest_smoke(study: Study) -> tuple[dict[str, Any] | None, Any]:
    rows = [r for r in study.ledger.list_runs("smoke") if r.status == "completed"]
    for row in reversed(rows):
        path = study.runs_dir / row.id / "smoke.json"
        if path.exists():
            return read_json(path), row
    return None, None


def _split_counts(study: Study, recorded: dict[str, Any]) -> dict[str, int]:
    """Examples per split: the latest snapshot's manifest, else what the sizing recorded."""
    from tunelab.data import load_snapshot
    from tunelab.errors import SnapshotError

    try:
        final = load_snapshot(study).manifest.get("counts", {}).get("final", {})
    except SnapshotError:
        final = recorded
    return {k: int(final.get(k) or recorded.get(k) or 0) for k in ("train", "validation", "test")}


def gather_figures(study: Study) -> dict[str, Any]:
    """The measured inputs of a plan, each with its source. Needs a sizing record."""
    from tunelab.sizing.stage import require_sizing

    cfg = study.config
    t = cfg.training
    sizing = require_sizing(study)
    thr = sizing.get("throughput") or {}
    own = next((r for r in sizing["configurations"] if r["label"] == thr.get("row")), None)
    if own is None or own["status"] != "ok" or not thr.get("step_s"):
        raise StudyError(
            f"sizing {sizing['id']} has no measured step of the study's configuration",
            hint="run `tunelab size` again (its first configuration must fit)",
        )
    m = own["measured"]
    lengths = sizing.get("lengths") or {}
    counts = lengths.get("split_counts") or {}
    quant = lengths.get("quantiles") or []
    measured_len = own["options"]["seq_len"]
    packing = bool(t.packing and sizing["facts"]["architecture"] == "causal_lm")
    micro = t.micro_batch_size
    if quant:
        typical = lengths.get("mean") if packing else expected_max(quant, micro)
        how = "mean length (packed)" if packing else f"expected longest of {micro} (padded)"
    else:
        typical, how = measured_len, "the measured length (--seq-len: no length distribution)"
    scale = (typical or measured_len) / measured_len
    sid = f"sizing {sizing['id']}"
    f: dict[str, Any] = {
        "device": sizing["device"],
        "sizing_id": sizing["id"],
        "step_s": Figure(
            thr["step_s"] * scale,
            f"{sid}: {thr['step_s']:.3f} s at {measured_len} tokens/example x {scale:.3f} ({how})",
        ),
        "forward_s": Figure(
            (m.get("forward_s") or 0.0) * scale, f"{sid}: one validation forward of a micro-batch"
        ),
        "load_s": Figure(m.get("load_s"), f"{sid}: model load and adaptation"),
        "step_cpu_share": m.get("cpu_share"),
        "encode_s": Figure(lengths.get("encode_train_s"), f"{sid}: tokenizing the training split"),
        "sizing_s": Figure(sizing.get("seconds"), f"{sid}: its own duration"),
        "tokens_per_s": Figure(thr.get("tokens_per_s"), sid),
        "counts": _split_counts(study, counts),
        "lengths": {k: lengths.get(k) for k in ("p50", "p95", "max", "mean")},
    }
    smoke, smoke_row = _latest_smoke(study)
    f["eval_s_per_example"] = Figure(None, "")
    if smoke is not None:
        sm = f"smoke {smoke_row.id}"
        f["checkpoint_save_s"] = Figure(smoke.get("checkpoint_save_s"), sm)
        f["reload_s"] = Figure(smoke.get("reload_s"), f"{sm}: load in a fresh process")
        f["smoke_s"] = Figure(run_seconds(smoke_row) or smoke.get("total_s"), f"{sm}: ledger")
        start = (smoke.get("fresh_process_s") or 0) - (smoke.get("reload_s") or 0)
        start -= (smoke.get("fresh_eval_s") or 0) + (smoke.get("fresh_checks_s") or 0)
        f["process_start_s"] = Figure(
            start if start > 0 else None,
            f"{sm}: its fresh process less the load, the evaluation and the smoke's own checks "
            "(start, imports, records)",
        )
    else:
        f["checkpoint_save_s"] = Figure(None, "no smoke record")
        f["reload_s"] = Figure(f["load_s"].value, "no smoke record: the sizing's load time")
        f["smoke_s"] = Figure(None, "no smoke record (run `tunelab smoke`)")
        f["process_start_s"] = Figure(None, "no smoke record")
    baselines = [r for r in study.ledger.list_runs("baseline") if r.status == "completed"]
    if baselines:
        row = baselines[-1]
        f["baseline_s"] = Figure(run_seconds(row), f"baseline {row.id}: ledger")
        ev = study.runs_dir / row.id / "metrics-validation.json"
        rec = read_json(ev) if ev.exists() else {}
        f["baseline_cpu_share"] = rec.get("cpu_share")
        if rec.get("seconds") and rec.get("n"):
            # the very procedure every variant's evaluation repeats, on the whole split
            f["eval_s_per_example"] = Figure(
                rec["seconds"] / rec["n"], f"baseline {row.id}: {rec['n']} examples evaluated"
            )
            f.update(
                _adapted_costs(
                    smoke,
                    smoke_row.id if smoke_row is not None else None,
                    rec,
                    row.id,
                    sizing["facts"],
                    cfg.adaptation.method,
                )
            )
    else:
        f["baseline_s"] = Figure(None, "no baseline yet: estimated")
    if f["eval_s_per_example"].value is None and smoke is not None:
        f["eval_s_per_example"] = Figure(
            smoke.get("eval_s_per_example"), f"smoke {smoke_row.id}: a few examples (high)"
        )
    if f["eval_s_per_example"].value is None:
        # a forward per example: right for a classifier, low for generation
        f["eval_s_per_example"] = Figure(
            f["forward_s"].value / max(1, micro), "estimated from the validation forward (low)"
        )
    f["base_hash_s"] = _base_hash_seconds(study)
    f["method"] = cfg.adaptation.method
    f["eval_max_examples"] = cfg.evaluation.max_examples
    f["load_avg_at_sizing"] = (sizing.get("env") or {}).get("load_avg_1m")
    f["logical_cores"] = ((sizing.get("env") or {}).get("cpu") or {}).get("logical_cores")
    if f["checkpoint_save_s"].value is None:
        f["checkpoint_save_s"] = Figure(1.0, "assumed 1 s (no smoke record)")
    return f


# ------------------------------------------------------------------ the plan (pure)


def _adapted_costs(
    smoke: dict[str, Any] | None,
    smoke_id: str | None,
    rec: dict[str, Any],
    baseline_id: str,
    facts: dict[str, Any],
    method: str,
) -> dict[str, Figure]:
    """What a variant's evaluation costs beside the baseline's run, which is its unit of work.

    - its load: the smoke's fresh process loading an adapted checkpoint, in place of the
      baseline's own load. The baseline is the first process to read the model's files and to
      import its modules after the data stages, and loaded 1.3-1.6 s slower than every later
      evaluation on the demo; the smoke's reload comes after it and loads what a variant loads.
    - per example, for a generating task: the length it will generate, its answers' and not the
      baseline's (`_answer_length_cost`); the adapter's cost below applies to that.
    - per example: unmerged LoRA layers add their own matmuls and calls. The smoke measures
      it: its examples evaluated with the adapter off, then on (`adapter_time_ratio`);
      SmolLM2 with LoRA on every linear layer decoded 1.22 times as slowly, for 1.82 % more
      parameters. Without that figure, the adapter's share of the parameters (from the
      sizing's facts), which is right for the FLOPs of a large batch. The smoke's absolute
      per-example time is not used: its few examples are one small batch whose per-example
      time holds the first batch's fixed costs (0.055 s against the baseline's 0.034 s on the
      demo, while the variants' evaluations took 0.031-0.033 s).
    """
    out: dict[str, Figure] = {}
    per_example = rec["seconds"] / rec["n"]
    length = _answer_length_cost(rec, baseline_id)
    if length is not None:
        out["answer_length_s_per_example"] = length
        per_example = max(0.0, per_example + length.value)
    if rec.get("load_s") is not None:
        out["baseline_load_s"] = Figure(rec["load_s"], f"baseline {baseline_id}: its model load")
    reload = (smoke or {}).get("reload_s")
    if reload is not None:
        out["eval_load_s"] = Figure(
            reload,
            f"smoke {smoke_id}: an adapted checkpoint loaded in a fresh process, after the "
            "baseline",
        )
    ratio = (smoke or {}).get("adapter_time_ratio")
    trainable, total = facts.get("trainable_params") or 0, facts.get("num_params") or 0
    step = (rec.get("generation") or {}).get("s_per_step")
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


def _answer_length_cost(rec: dict[str, Any], baseline_id: str) -> Figure | None:
    """Per example, what generating the gold answers' length takes beyond what the baseline
    generated (negative: less), at the baseline's own prefill and step times, batch by batch.

    A trained variant stops after the answer it learned; the base model may ramble to
    `max_new_tokens`. On the extraction demo SmolLM2 generated 64 tokens in each of its 3
    batches, while the answers' longest per batch were about 40: priced at the baseline's
    length, the variants' evaluations came out a third too long. None for a task that does not
    generate (classification) or a record without generation timings."""
    gen = rec.get("generation") or {}
    batches = gen.get("batches") or []
    if not batches or not rec.get("n"):
        return None
    answered = 0.0
    for b in batches:
        step = b["decode_s"] / (b["steps"] - 1) if b["steps"] > 1 else gen.get("s_per_step") or 0
        answered += b["prefill_s"] + max(0, b["answer_steps"] - 1) * step
    generated = sum(b["prefill_s"] + b["decode_s"] for b in batches)
    return Figure(
        (answered - generated) / rec["n"],
        f"baseline {baseline_id}: {gen['steps']} generated tokens in {len(batches)} batches; "
        f"the validation answers (tokens and EOS) take {gen['answer_steps']}",
    )


def _base_hash_seconds(study: Study) -> Figure:
    """Seconds to sha256 the base model's files: their size over a hashing rate measured now."""
    from tunelab.models.identity import identity_files
    from tunelab.study import resolve_path

    path = resolve_path(study.config.model.path, study.root)
    try:
        # the files the export's identity check hashes
        files = [path / n for n in identity_files(path)] if path.is_dir() else [path]
        size = sum(p.stat().st_size for p in files)
    except OSError as exc:
        return Figure(None, f"base files not readable ({exc.strerror}): hashing not counted")
    rate = hash_rate()
    return Figure(size / rate, f"{size / 2**20:.0f} MiB of base files at {rate / 2**20:.0f} MiB/s")


def hash_rate() -> float:
    """Bytes per second sha256 hashes on this machine now (16 MiB timed)."""
    import hashlib
    import time

    block = bytes(16 * 2**20)
    started = time.perf_counter()
    hashlib.sha256(block).hexdigest()
    return len(block) / max(1e-9, time.perf_counter() - started)


def _v(fig: Any) -> float:
    if isinstance(fig, Figure):
        return float(fig.value or 0.0)
    if isinstance(fig, dict):
        return float(fig.get("value") or 0.0)
    return float(fig or 0.0)


def training_steps(max_steps: int | None, num_epochs: float, n_train: int, effective: int) -> int:
    if max_steps:
        return int(max_steps)
    return max(1, math.ceil(num_epochs * n_train / max(1, effective)))


def build_plan(
    figures: dict[str, Any],
    *,
    training: dict[str, Any],
    budget: dict[str, Any],
    days: int,
    gpu_hour_price: float | None = None,
    speedup: float = 1.0,
    step_time_s: float | None = None,
) -> dict[str, Any]:
    """Phases, durations (s), margins, what fits, cost. Pure: values in, values out."""
    speedup = float(speedup or 1.0)
    price = float(budget["gpu_hour_price"] if gpu_hour_price is None else gpu_hour_price)
    counts = figures["counts"]
    n_train, n_val, n_test = counts["train"], counts["validation"], counts["test"]
    # an evaluation reads the first `evaluation.max_examples` of its split; training's
    # validation passes read all of it
    cap = figures.get("eval_max_examples") or max(n_val, n_test)
    eval_val, eval_test = min(n_val, cap), min(n_test, cap)
    micro, accum = training["micro_batch_size"], training["grad_accum_steps"]
    steps = training_steps(training["max_steps"], training["num_epochs"], n_train, micro * accum)
    step_s = step_time_s if step_time_s else _v(figures["step_s"]) / speedup
    forward_s = _v(figures["forward_s"]) / speedup
    eval_per_ex = _v(figures["eval_s_per_example"]) / speedup
    load_s, save_s, reload_s = (
        _v(figures["load_s"]),
        _v(figures["checkpoint_save_s"]),
        _v(figures["reload_s"]),
    )
    encode_s = _v(figures["encode_s"]) * (n_train + n_val) / max(1, n_train)
    every_eval, every_ckpt = (
        training.get("eval_every_steps"),
        training.get("checkpoint_every_steps"),
    )
    n_val_passes = 0
    if every_eval and n_val:
        n_val_passes = 1 + steps // every_eval + (1 if steps % every_eval else 0)
    val_pass_s = math.ceil(n_val / micro) * forward_s if n_val else 0.0
    n_saves = (steps // every_ckpt + (1 if steps % every_ckpt else 0)) if every_ckpt else 1
    variant = {
        "startup_s": encode_s + load_s,
        "steps": steps,
        "steps_s": steps * step_s,
        "validation_passes": n_val_passes,
        "validation_s": n_val_passes * val_pass_s,
        "checkpoint_saves": n_saves,
        "checkpoints_s": n_saves * save_s,
    }
    variant["total_s"] = (
        variant["startup_s"]
        + variant["steps_s"]
        + variant["validation_s"]
        + variant["checkpoints_s"]
    )
    # an evaluation run is the baseline's unit of work again (the split, the records), with a
    # variant's load (see _adapted_costs); a load is files and imports: no faster GPU speeds it
    baseline_s = _v(figures.get("baseline_s"))
    # a variant's example beside the baseline's: the length it generates, the adapter's matmuls
    variant_extra = (
        _v(figures.get("answer_length_s_per_example"))
        + _v(figures.get("adapted_extra_s_per_example"))
    ) / speedup
    if baseline_s:
        base_load = _v(figures.get("baseline_load_s"))
        eval_load = _v(figures.get("eval_load_s")) or base_load
        eval_run_s = max(0.0, baseline_s - base_load) / speedup + eval_load
    else:
        eval_run_s = reload_s + eval_val * eval_per_ex
    eval_run_s = max(0.0, eval_run_s + eval_val * variant_extra)
    variant_per_ex = max(0.0, eval_per_ex + variant_extra)
    overhead_s = max(0.0, eval_run_s - eval_val * variant_per_ex)
    final_test_s = overhead_s + eval_test * variant_per_ex
    # the same evaluation in a new process: its start and imports as the smoke's fresh one took
    verify_s = eval_run_s + (_v(figures.get("process_start_s")) or PROCESS_START_S)
    interval = min(every_ckpt or steps, steps)
    resume_each = interval / 2 * step_s + variant["startup_s"] + reload_s
    # an export hashes the base (the check that it did not change since training), copies the
    # trained weights and hashes the copy (about one save); a freeze run loads its model to save
    # it whole
    hash_s = _v(figures.get("base_hash_s"))
    export_s = hash_s + save_s + EXPORT_FIXED_S
    if figures.get("method", "lora") == "freeze":
        export_s += load_s
    initial = {
        "environment": ENV_CHECK_S,
        "smoke": _v(figures.get("smoke_s")) or (variant["startup_s"] + 4 * step_s + eval_run_s),
        "sizing": _v(figures.get("sizing_s")),
        "baseline": _v(figures.get("baseline_s")) or (load_s + eval_val * eval_per_ex),
    }
    n_var = int(budget["num_variants"])
    raw = {
        "initial check": sum(initial.values()),
        "experiments": n_var * variant["total_s"],
        "evaluation": n_var * eval_run_s + verify_s + final_test_s,
        "resumption margin": n_var * resume_each,
        "export": export_s,
    }
    phases = []
    clock = 0.0
    for name in PHASES:
        base = raw[name]
        margin = MARGINS[name] * base
        phases.append(
            {
                "phase": name,
                "start_s": clock,
                "planned_s": base,
                "margin_s": margin,
                "margin_pct": round(100 * MARGINS[name]),
                "total_s": base + margin,
            }
        )
        clock += base + margin
    window_s = days * float(budget["hours_per_day"]) * 3600.0
    busy_s = clock
    per_variant_s = (
        variant["total_s"] * (1 + MARGINS["experiments"])
        + eval_run_s * (1 + MARGINS["evaluation"])
        + resume_each
    )
    fixed_s = busy_s - n_var * per_variant_s
    fit = max(0, int((window_s - fixed_s) // per_variant_s)) if per_variant_s > 0 else n_var
    warnings = []
    if fit < n_var:
        warnings.append(
            f"{n_var} registered variants do not fit {days} days x {budget['hours_per_day']:g} "
            f"h: {fit} fit (each needs {per_variant_s / 3600:.2f} h with margins)"
        )
    load, cores = figures.get("load_avg_at_sizing"), figures.get("logical_cores")
    if load and cores and load > cores:
        warnings.append(
            f"the step was measured on a busy machine (load average {load:g} on {cores} cores): "
            "durations scale with the load at run time; `tunelab plan --review` shows both"
        )
    measured_busy = {  # what was timed: (its CPU share, what it prices, the command again)
        "the sizing's timed steps": (figures.get("step_cpu_share"), "training step", "size"),
        "the baseline's evaluation": (figures.get("baseline_cpu_share"), "evaluation", "baseline"),
    }
    for what, (share, priced, command) in measured_busy.items():
        if share is not None and share < BUSY_CPU_SHARE:
            warnings.append(
                f"{what} had {100 * share:.0f} % of its threads' CPU time (about 95 % on a "
                f"quiet machine): another process shared the cores, and every {priced} in this "
                f"plan is priced at that slower speed; run `tunelab {command}` again on a quiet "
                "machine, then plan"
            )
    if figures.get("device") == "cpu" and speedup == 1.0 and not step_time_s:
        warnings.append(
            "figures measured on CPU: this is a plan for this CPU; pass --speedup X or "
            "--step-time-s S to project the rented GPU"
        )
    return {
        "days": days,
        "hours_per_day": budget["hours_per_day"],
        "gpu": budget.get("gpu"),
        "gpu_hour_price": price,
        "speedup": speedup,
        "step_time_s": step_s,
        "num_variants": n_var,
        "variants_that_fit": fit,
        "fits": fit >= n_var,
        "variant": variant,
        "per_variant_with_margins_s": per_variant_s,
        "evaluation_run_s": eval_run_s,
        "final_test_s": final_test_s,
        "verify_s": verify_s,
        "resume_each_s": resume_each,
        "export_s": export_s,
        "initial": initial,
        "phases": phases,
        "margins": dict(MARGINS),
        "busy_s": busy_s,
        "window_s": window_s,
        "cost": {
            "busy_hours": busy_s / 3600,
            "busy_cost": busy_s / 3600 * price,
            "rental_hours": days * 24,
            "rental_cost": days * 24 * price,
        },
        "warnings": warnings,
    }


# ------------------------------------------------------------------ records and chart


def plans_dir(study: Study) -> Path:
    return study.records / "plans"


def latest_plan(study: Study) -> dict[str, Any] | None:
    found = sorted(plans_dir(study).glob("plan-*.json")) if plans_dir(study).is_dir() else []
    return read_json(found[-1]) if found else None


def draw_gantt(plan: dict[str, Any], path: Path) -> Path:
    """The phases on a time axis (hours), each variant a bar, margins hatched, the window's end."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "initial check": "#4C72B0",
        "experiments": "#55A868",
        "evaluation": "#8172B2",
        "resumption margin": "#CCB974",
        "export": "#C44E52",
    }
    rows: list[tuple[str, float, float, float, str]] = []  # label, start, length, margin, phase
    for ph in plan["phases"]:
        name, start = ph["phase"], ph["start_s"] / 3600
        if name == "experiments" and plan["num_variants"] > 0:
            each = ph["planned_s"] / plan["num_variants"] / 3600
            each_margin = ph["margin_s"] / plan["num_variants"] / 3600
            for i in range(plan["num_variants"]):
                rows.append((f"variant {i + 1}", start, each, each_margin, name))
                start += each + each_margin
        else:
            rows.append((name, start, ph["planned_s"] / 3600, ph["margin_s"] / 3600, name))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    for y, (_label, start, length, margin, phase) in enumerate(rows):
        ax.barh(y, length, left=start, color=colours[phase], edgecolor="black", linewidth=0.4)
        if margin > 0:
            ax.barh(
                y,
                margin,
                left=start + length,
                color="white",
                edgecolor=colours[phase],
                hatch="///",
                linewidth=0.6,
            )
    window_h = plan["window_s"] / 3600
    end_h = plan["busy_s"] / 3600
    if window_h <= 1.5 * end_h:
        ax.axvline(window_h, color="red", linestyle="--", linewidth=1)
        ax.text(window_h, -0.8, " end of rental", color="red", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("hours from the start of the rental (hatched: margin)")
    status = "fits" if plan["fits"] else "DOES NOT FIT"
    ax.set_title(
        f"{plan['days']}-day plan on {plan['gpu'] or 'the device'}: {end_h:.2f} h busy of "
        f"{window_h:.0f} h, {plan['num_variants']} variants ({status}), "
        f"{plan['cost']['rental_cost']:,.0f} rental",
        fontsize=9,
    )
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue())


def make_plan(
    study: Study,
    *,
    days: int | None = None,
    gpu_hour_price: float | None = None,
    speedup: float = 1.0,
    step_time_s: float | None = None,
) -> tuple[dict[str, Any], Path, Path]:
    """Gather the figures, build the plan, write records/plans/<id>.json and <id>.png."""
    from tunelab.errors import ConfigError

    cfg = study.config
    days = int(days or cfg.budget.rental_days)
    if days not in (3, 7, 30):
        raise ConfigError(f"--days {days}: plans are for 3, 7 or 30 days", hint="--days 3|7|30")
    if speedup <= 0 or (step_time_s is not None and step_time_s <= 0):
        raise ConfigError("--speedup and --step-time-s must be positive", hint="e.g. --speedup 20")
    figures = gather_figures(study)
    plan = build_plan(
        figures,
        training=cfg.training.model_dump(mode="json"),
        budget=cfg.budget.model_dump(mode="json"),
        days=days,
        gpu_hour_price=gpu_hour_price,
        speedup=speedup,
        step_time_s=step_time_s,
    )
    plan_id = f"plan-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    record = {
        "id": plan_id,
        "kind": "plan",
        "created_at": utc_now(),
        "config_sha256": cfg.sha256(),
        "figures": {k: (v.to_dict() if isinstance(v, Figure) else v) for k, v in figures.items()},
        **plan,
        "chart": f"{plan_id}.png",
    }
    folder = plans_dir(study)
    record["gantt_png"] = str(folder / f"{plan_id}.png")
    # what the ledger already holds, set against this plan (the report shows it)
    record["review"] = review_plan(study, record)
    actual = {r["phase"]: r["actual_s"] for r in record["review"]["rows"]}
    for ph in record["phases"]:
        ph["name"] = ph["phase"]
        ph["planned_h"] = round(ph["total_s"] / 3600, 4)
        ph["actual_h"] = (
            None if not actual.get(ph["phase"]) else round(actual[ph["phase"]] / 3600, 4)
        )
    png = draw_gantt(plan, folder / f"{plan_id}.png")
    path = write_json_atomic(folder / f"{plan_id}.json", record)
    study.ledger.add_event(
        None, "plan:recorded", {"id": plan_id, "fits": plan["fits"], "busy_s": plan["busy_s"]}
    )
    return record, path, png


# ------------------------------------------------------------------ review


def _verify_seconds(study: Study) -> list[float]:
    out = []
    for path in sorted(study.runs_dir.glob("*/verify*.json")) if study.runs_dir.is_dir() else []:
        rec = read_json(path)
        if isinstance(rec, dict) and rec.get("seconds") and rec.get("model_run"):
            out.append(float(rec["seconds"]))
    return out


def _export_seconds(study: Study) -> list[float]:
    done, seconds = {}, {}
    for e in study.ledger.events():
        if e["kind"] == "export" and e["detail"]:
            try:
                detail = json.loads(e["detail"])
                done[detail.get("export_id")] = _parse_time(e["at"])
                if isinstance(detail.get("seconds"), int | float):
                    seconds[detail.get("export_id")] = float(detail["seconds"])
            except (ValueError, AttributeError):
                continue
    out = list(seconds.values())
    for export_id, end in done.items():
        if export_id in seconds:
            continue  # timed by the export itself
        manifest = study.records / "exports" / str(export_id) / "tunelab-manifest.json"
        if manifest.exists() and end is not None:
            start = _parse_time(read_json(manifest).get("created_at"))
            if start is not None:
                out.append(max(0.0, (end - start).total_seconds()))
    return out


def _mean_step_s(study: Study, run_id: str) -> float | None:
    """Mean seconds of a training run's optimizer steps, from its metrics.jsonl."""
    path = study.runs_dir / run_id / "metrics.jsonl"
    if not path.exists():
        return None
    from tunelab.records import read_jsonl

    steps = [r["seconds"] for r in read_jsonl(path) if "loss" in r and r.get("seconds")]
    return sum(steps) / len(steps) if steps else None


def _eval_speed_factor(study: Study, run_id: str, figures: dict[str, Any]) -> float:
    """How fast an evaluation ran against the plan's unit of work: a generating one by its
    seconds per decoding step (how many steps it took is the plan's to get right), any other
    by its seconds per example. 1.0 when either side is missing."""

    def value(key: str) -> float | None:
        return (figures.get(key) or {}).get("value")

    for path in sorted((study.runs_dir / run_id).glob("metrics-*.json")):
        rec = read_json(path)
        if not (isinstance(rec, dict) and rec.get("seconds") and rec.get("n")):
            continue
        step, planned_step = (
            (rec.get("generation") or {}).get("s_per_step"),
            value("variant_s_per_step"),
        )
        if step and planned_step:
            return step / planned_step
        per_example = value("eval_s_per_example")
        return rec["seconds"] / rec["n"] / per_example if per_example else 1.0
    return 1.0


def _n(count: int, noun: str) -> str:
    """'1 export', '2 exports'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _pct(planned: float | None, actual: float | None) -> float | None:
    return round(100 * (planned - actual) / actual, 1) if planned and actual else None


def repeat_spread(seconds: list[float]) -> float | None:
    """How much one unit of work varied when it ran more than once: (max - min) / mean, in %.

    A plan from one earlier sample cannot be closer to a phase than the phase's own units are
    to each other: on this 2-core VM the demo's evaluation of one variant took 7.5 to 9.9 s in
    six runs within ten minutes, nothing else running."""
    if len(seconds) < 2:
        return None
    mean = sum(seconds) / len(seconds)
    return round(100 * (max(seconds) - min(seconds)) / mean, 1) if mean > 0 else None


def repeat_verdict(row: dict[str, Any]) -> str | None:
    """'evaluation: its 2 evaluations of one split took 8.7 and 7.5 s, a spread of 15.0 %; the
    phase's error -11.2 % is inside it: ...' for a review row whose unit ran more than once,
    one sentence for the CLI and the dossier; None when it ran once or nothing was measured."""
    if row.get("repeat_spread_pct") is None or row.get("error_pct") is None:
        return None
    times = " and ".join(f"{x:.1f}" for x in row["repeats_s"])
    verdict = (
        "inside it: the plan is as close as the runs are to each other"
        if row["within_repeat_spread"]
        else "outside it"
    )
    return (
        f"{row['phase']}: its {len(row['repeats_s'])} evaluations of one split took {times} s, "
        f"a spread of {row['repeat_spread_pct']:.1f} %; the phase's error "
        f"{row['error_pct']:+.1f} % is {verdict}"
    )


def review_plan(study: Study, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Planned against actual, phase by phase, for the units the ledger holds.

    Each row also gives the plan recomputed at the speed the runs themselves measured (their
    own mean step time, their own evaluation seconds per example): on a machine whose load
    changes between sizing and training, the first error mixes the speed change with the
    plan's arithmetic, the second shows the arithmetic alone.
    """
    from tunelab.sizing.stage import list_sizings

    plan = plan or latest_plan(study)
    if plan is None:
        raise StudyError("no plan in records/plans/", hint="make one first: `tunelab plan`")
    runs = [r for r in study.list_runs() if r.status != "running" and run_seconds(r) is not None]

    def of(kind: str) -> list[Any]:
        return [r for r in runs if r.kind == kind]

    smoke, baseline = of("smoke"), of("baseline")
    sizing = [read_json(p).get("seconds") or 0.0 for p in list_sizings(study)]
    train, evals = of("train"), of("eval")
    verify = _verify_seconds(study)
    exports = _export_seconds(study)
    init, v = plan["initial"], plan["variant"]
    # experiments at each run's own speed: compute scaled, checkpoint saves as planned
    at_speed_train = 0.0
    for r in train:
        step = _mean_step_s(study, r.id)
        factor = step / plan["step_time_s"] if step and plan["step_time_s"] else 1.0
        compute = v["startup_s"] + v["steps_s"] + v["validation_s"]
        at_speed_train += compute * factor + v["checkpoints_s"]
    eval_factors = [_eval_speed_factor(study, r.id, plan.get("figures") or {}) for r in evals]
    mean_factor = sum(eval_factors) / len(eval_factors) if eval_factors else 1.0
    planned_eval = len(evals) * plan["evaluation_run_s"] + len(verify) * plan["verify_s"]
    at_speed_eval = (
        sum(f * plan["evaluation_run_s"] for f in eval_factors)
        + len(verify) * plan["verify_s"] * mean_factor
    )
    margins = {ph["phase"]: ph.get("margin_pct") for ph in plan.get("phases") or []}
    # the same unit run more than once: the evaluations of one split (eval-validation, ...)
    same_unit: dict[str, list[float]] = {}
    for r in evals:
        same_unit.setdefault(r.name or "eval", []).append(run_seconds(r))
    repeated = max(same_unit.values(), key=len, default=[])
    rows = [
        {
            "phase": "initial check",
            "what": f"{len(smoke)} smoke, {len(sizing)} sizing, {len(baseline)} baseline "
            "(measured before planning)",
            "planned_s": (init["smoke"] if smoke else 0)
            + (init["sizing"] if sizing else 0)
            + (init["baseline"] if baseline else 0),
            "actual_s": (run_seconds(smoke[-1]) if smoke else 0)
            + (sizing[-1] if sizing else 0)
            + (run_seconds(baseline[-1]) if baseline else 0),
            "planned_at_run_speed_s": None,
        },
        {
            "phase": "experiments",
            "what": f"{len(train)} of {_n(plan['num_variants'], 'training run')}",
            "planned_s": len(train) * v["total_s"],
            "actual_s": sum(run_seconds(r) for r in train),
            "planned_at_run_speed_s": at_speed_train if train else None,
        },
        {
            "phase": "evaluation",
            "what": f"{_n(len(evals), 'evaluation')}, {_n(len(verify), 'verification')}",
            "planned_s": planned_eval,
            "actual_s": sum(run_seconds(r) for r in evals) + sum(verify),
            "planned_at_run_speed_s": at_speed_eval if evals else None,
            "repeats_s": repeated if len(repeated) > 1 else None,
        },
        {
            "phase": "resumption margin",
            "what": _n(sum(1 for r in train if r.status == "interrupted"), "interrupted run"),
            "planned_s": plan["resume_each_s"] * plan["num_variants"],
            "actual_s": None,
            "planned_at_run_speed_s": None,
        },
        {
            "phase": "export",
            "what": _n(len(exports), "export"),
            "planned_s": len(exports) * plan["export_s"],
            "actual_s": sum(exports),
            "planned_at_run_speed_s": None,
        },
    ]
    for r in rows:
        r["error_pct"] = _pct(r["planned_s"], r["actual_s"])
        r["error_at_run_speed_pct"] = _pct(r["planned_at_run_speed_s"], r["actual_s"])
        r.setdefault("repeats_s", None)
        r["repeat_spread_pct"] = repeat_spread(r["repeats_s"] or [])
        r["within_repeat_spread"] = (
            abs(r["error_pct"]) <= r["repeat_spread_pct"]
            if r["error_pct"] is not None and r["repeat_spread_pct"] is not None
            else None
        )
        r["below_resolution"] = bool(
            r["error_pct"] is not None and max(r["planned_s"], r["actual_s"]) < RESOLUTION_S
        )
        # did the phase's stated margin absorb what it took? (what a rental schedule needs)
        margin = margins.get(r["phase"])
        r["margin_pct"] = margin
        r["within_margin"] = (
            r["actual_s"] <= r["planned_s"] * (1 + margin / 100)
            if r["error_pct"] is not None and margin is not None
            else None
        )
    measured = [
        r
        for r in rows
        if r["error_pct"] is not None
        and r["phase"] != "initial check"
        and not r["below_resolution"]
    ]
    at_speed = [r for r in rows if r["error_at_run_speed_pct"] is not None]
    return {
        "plan": plan["id"],
        "rows": rows,
        "max_error_pct": max((abs(r["error_pct"]) for r in measured), default=None),
        "max_error_at_run_speed_pct": max(
            (abs(r["error_at_run_speed_pct"]) for r in at_speed), default=None
        ),
    }
