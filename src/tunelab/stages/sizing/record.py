"""The sizing record: each row's predicted breakdown set beside its measurement
(`compare_row`), the record `records/sizing/<id>.json` written once with its ledger event, and
the latest read back as `core.record_types.Sizing` (`require_sizing`).
"""

from __future__ import annotations

import os
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.core.errors import StudyError
from tunelab.core.evidence import latest, sizing_dir
from tunelab.core.ledger import utc_now
from tunelab.core.record_sizing import (
    WRITING,
    SizingConfiguration,
    SizingEnv,
    SizingLengths,
    SizingMeasured,
    SizingRecommendation,
    SizingThroughput,
)
from tunelab.core.record_types import Sizing
from tunelab.core.records import write_json_atomic
from tunelab.core.study import Study
from tunelab.stages.sizing.memory import estimate_memory
from tunelab.stages.sizing.process_memory import MMAP_THRESHOLD
from tunelab.stages.sizing.recommend import own_label
from tunelab.stages.sizing.terms import Case, ModelFacts


def new_sizing_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"size-{stamp}-{secrets.token_hex(3)}"


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
    compared = est.peak_total if cuda else est.peak_increase
    predicted = {**est.to_dict(), "compared": compared}
    # The rule says weights x 4 in all; over a process already holding the weights: x 3.
    rule = est.rule_x4 if cuda else est.rule_x4 - est.weights
    found = SizingMeasured.of(WRITING, measured or {}, "measured")
    real = found.peak_total if cuda else found.increase
    out = {
        "predicted": predicted,
        "rule_x4": {"bytes": rule, "error_pct": _pct(rule, real)},
        "error_pct": _pct(compared, real),
        "compared": "max_allocated" if cuda else "peak RSS - idle RSS",
    }
    if measured is not None:
        measured["compared"] = real
    return out


def save_sizing(study: Study, record: dict[str, Any]) -> Path:
    """records/sizing/<id>.json, and its event in the ledger."""
    sizing = Sizing.of(WRITING, record)  # checked as its kind before it is written
    path = write_json_atomic(sizing_dir(study) / f"{sizing.id}.json", record)
    keys = ("id", "max_error_pct", "seconds")
    study.ledger.add_event(None, "sizing:recorded", {k: record[k] for k in keys})
    return path


def sizing_record(
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
    measured = as_configurations(rows)
    rate = SizingThroughput.of(WRITING, throughput, "throughput")
    return {
        "id": new_sizing_id(),
        "kind": "sizing",
        "created_at": utc_now(),
        "seconds": None,
        "config_sha256": cfg.sha256(),
        # require_hypothesis's summary of the locked record: {version, sha256, ...}
        "hypothesis_version": hypothesis["version"],
        "hypothesis_sha256": hypothesis["sha256"],
        "data_snapshot": SizingLengths.of(WRITING, lengths, "lengths").snapshot,
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
        "max_error_pct": _max_abs(r.error_pct for r in measured),
        "rule_x4_max_error_pct": _max_abs(r.rule.error_pct for r in measured),
        "recommendation": rec,
        "projection": projection,
        "throughput": throughput,
        "step_s": rate.step_s,
        "tokens_per_s": rate.tokens_per_s,
    }


def as_configurations(rows: list[dict[str, Any]]) -> list[SizingConfiguration]:
    """The rows `tunelab size` is building, read as the record's configurations."""
    return [
        SizingConfiguration.of(WRITING, row, f"configurations[{i}]") for i, row in enumerate(rows)
    ]


def flatten_row(row: dict[str, Any]) -> None:
    """Flat copies of the figures a table shows (the report reads them)."""
    found = as_configurations([row])[0]
    m = found.measurement
    row.update(
        seq_len=found.options.seq_len,
        micro_batch=found.options.micro_batch,
        predicted_mb=round((found.prediction.compared or 0) / 2**20, 2),
        measured_mb=round(m.compared / 2**20, 2) if m.compared else None,
        step_s=m.projected_step_s,
    )


def _throughput(
    rows: list[dict[str, Any]], rec: dict[str, Any], sizes: list[int]
) -> dict[str, Any]:
    """The step time and tokens/s the planner uses: the study's own configuration at the most
    typical length measured (the first), and the recommended one's when it was measured."""
    own = next((r for r in as_configurations(rows) if r.label == own_label(sizes[0])), None)
    out: dict[str, Any] = {}
    if own and own.status == "ok":
        m = own.measurement
        out = {
            "row": own.label,
            "seq_len": own.options.seq_len,
            "step_s": m.projected_step_s,
            "micro_step_s": m.micro_step_s,
            "tokens_per_s": m.tokens_per_s,
            "examples_per_s": m.examples_per_s,
        }
    recommended = SizingRecommendation.of(WRITING, rec, "recommendation").tokens_per_s
    if recommended:
        out["recommended_tokens_per_s"] = recommended
    return out


def _max_abs(values: Any) -> float | None:
    """The error of largest magnitude, with its sign."""
    found = [v for v in values if v is not None]
    return round(max(found, key=abs), 2) if found else None


def _env_summary(env: dict[str, Any]) -> dict[str, Any]:
    """The machine in short (`core.env.capture_env`'s, read as the record's `env`)."""
    found = SizingEnv.of(WRITING, env, "env")
    return {
        "torch": found.torch,
        "backend": found.backend,
        "cpu": found.cpu,
        "gpus": found.gpus,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "packages": found.packages,
    }


def require_sizing(study: Study) -> Sizing:
    """The latest sizing record, read as its kind (`core.record_types.Sizing`)."""
    found = latest(study, "sizing")
    if found is None:
        raise StudyError(
            "no sizing record in records/sizing/", hint="measure the step first: `tunelab size`"
        )
    return Sizing.read(found.path)
