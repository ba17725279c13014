"""Which configurations to measure, and the recommendation: pure functions over values.

- `configurations`: the study's own configuration at every representative length, then, at the
  longest length, each option changed alone (activation checkpointing, each micro-batch size,
  each precision), then the changed options combined.
- `recommend`: the largest micro-batch (and the accumulation that keeps the configured
  effective batch) whose predicted peak, calibrated on the measurements, fits the memory budget
  with a safety margin; without activation checkpointing when possible, since it costs time.

`parse_precisions(text)`, `parse_bytes`, `parse_int_list`; `configurations(...,
can_checkpoint=)` and `recommend(..., strategy=, ranks=, can_checkpoint=)` (estimate_memory's
strategy and ranks, default single).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, get_args

from tunelab.core.config_training import TrainingConfig
from tunelab.core.errors import ConfigError
from tunelab.core.record_sizing import SizingConfiguration
from tunelab.stages.sizing.memory import estimate_memory
from tunelab.stages.sizing.terms import Case, ModelFacts

SAFETY_MARGIN = 0.10
# training.precision's choices, as the config declares them
PRECISIONS: tuple[str, ...] = get_args(TrainingConfig.model_fields["precision"].annotation)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, what: str = "--memory-budget") -> int:
    """'24GB', '24 GiB', '500MB', '2e9' -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"{what} {text!r} is not a size",
            hint="write a number with a unit, e.g. 24GB, 80GiB or 512MB",
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be positive", hint="e.g. 24GB")
    return int(value)


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (positive integers)."""
    try:
        values = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(
            f"{what} {text!r} is not a list of positive integers", hint=f"e.g. {what} 1,2,4,8"
        )
    return sorted(set(values))


def parse_precisions(text: str, what: str = "--precision") -> list[str]:
    """'fp32,bf16' -> ['fp32', 'bf16'], each one of PRECISIONS."""
    values = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [p for p in values if p not in PRECISIONS]
    if bad:
        raise ConfigError(f"{what} {bad}: unknown", hint=f"choose among {', '.join(PRECISIONS)}")
    return values


def accumulation_for(effective_batch: int, micro_batch: int) -> int:
    return max(1, math.ceil(effective_batch / micro_batch))


@dataclass(frozen=True)
class Option:
    """One configuration to measure."""

    label: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    precision: str
    checkpointing: bool
    packing: bool
    changes: tuple[str, ...] = ()

    def key(self) -> tuple[Any, ...]:
        return (
            self.seq_len,
            self.micro_batch,
            self.grad_accum,
            self.precision,
            self.checkpointing,
            self.packing,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["changes"] = list(self.changes)
        return d


def own_label(seq_len: int) -> str:
    """The row label of the study's own configuration measured at `seq_len` tokens."""
    return f"config @{seq_len}"


def configurations(
    *,
    lengths: list[int],
    micro_batch: int,
    effective_batch: int,
    precision: str,
    checkpointing: bool,
    packing: bool,
    micro_batches: list[int] | None = None,
    precisions: list[str] | None = None,
    can_checkpoint: bool = True,
) -> list[Option]:
    """The configurations to measure, the study's own first (see the module docstring);
    without the checkpointing ones for a model that cannot checkpoint (`can_checkpoint`)."""
    lengths = sorted(set(lengths))
    longest = lengths[-1]
    base = Option(
        "config",
        longest,
        micro_batch,
        accumulation_for(effective_batch, micro_batch),
        precision,
        checkpointing,
        packing,
    )
    out = [replace(base, label=own_label(n), seq_len=n) for n in lengths]
    alone: list[Option] = []
    ck = "ckpt " + ("off" if checkpointing else "on")
    if can_checkpoint:
        alone.append(replace(base, label=ck, checkpointing=not checkpointing, changes=(ck,)))
    for m in micro_batches or []:
        if m != micro_batch:
            change = f"micro {m}"
            alone.append(
                replace(
                    base,
                    label=change,
                    micro_batch=m,
                    grad_accum=accumulation_for(effective_batch, m),
                    changes=(change,),
                )
            )
    for p in precisions or []:
        if p != precision:
            alone.append(replace(base, label=p, precision=p, changes=(p,)))
    out += alone
    # combined: checkpointing on, the largest micro-batch asked, the first other precision
    combined = replace(base, checkpointing=can_checkpoint or checkpointing)
    changes = [] if checkpointing or not can_checkpoint else ["ckpt on"]
    bigger = [m for m in (micro_batches or []) if m > micro_batch]
    if bigger:
        m = max(bigger)
        combined = replace(combined, micro_batch=m, grad_accum=accumulation_for(effective_batch, m))
        changes.append(f"micro {m}")
    other = [p for p in (precisions or []) if p != precision]
    if other:
        combined = replace(combined, precision=other[0])
        changes.append(other[0])
    if len(changes) >= 2:
        out.append(
            replace(combined, label="combined: " + " + ".join(changes), changes=tuple(changes))
        )
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for o in out:
        if o.key() not in seen:
            seen.add(o.key())
            unique.append(o)
    return unique


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def calibration(rows: list[SizingConfiguration]) -> float:
    """max(1, measured / predicted) over the measured rows: predictions are only ever raised."""
    pairs = [(r.measurement.compared, r.prediction.compared) for r in rows if r.status == "ok"]
    return max([1.0, *(m / p for m, p in pairs if m and p)])


def recommend(
    facts: ModelFacts,
    template: Case,
    *,
    effective_batch: int,
    budget_bytes: int,
    fixed_bytes: int,
    compare_total: bool,
    scale: float = 1.0,
    margin: float = SAFETY_MARGIN,
    strategy: str = "single",
    ranks: int = 1,
    can_checkpoint: bool = True,
) -> dict[str, Any]:
    """The largest micro-batch dividing `effective_batch` that fits `budget_bytes * (1 - margin)`.

    The predicted peak of a candidate is `fixed_bytes + scale * estimate` where the estimate is
    the peak increase (CPU: what a step adds to the idle process, `fixed_bytes` being the idle
    RSS) or the peak total (CUDA: `fixed_bytes` 0). Candidates without activation checkpointing
    come first when the template has it off. `strategy` and `ranks` estimate one rank of a
    DDP or FSDP run (`estimate_memory`). Returns the choice and every candidate tried.
    """
    limit = budget_bytes * (1.0 - margin)
    tried: list[dict[str, Any]] = []
    orders = [template.checkpointing] + (
        [True] if not template.checkpointing and can_checkpoint else []
    )
    for ckpt in orders:
        for micro in sorted(divisors(effective_batch), reverse=True):
            case = replace(
                template,
                micro_batch=micro,
                grad_accum=accumulation_for(effective_batch, micro),
                checkpointing=ckpt,
            )
            est = estimate_memory(facts, case, strategy=strategy, ranks=ranks)
            part = est.peak_total if compare_total else est.peak_increase
            peak = int(fixed_bytes + scale * part)
            fits = peak <= limit
            tried.append(
                {
                    "micro_batch": micro,
                    "grad_accum": case.grad_accum,
                    "checkpointing": ckpt,
                    "predicted_peak_bytes": peak,
                    "fits": fits,
                }
            )
            if fits:
                return {
                    "fits": True,
                    "micro_batch": micro,
                    "grad_accum": case.grad_accum,
                    "effective_batch": micro * case.grad_accum,
                    "checkpointing": ckpt,
                    "precision": template.precision,
                    "seq_len": template.seq_len,
                    "predicted_peak_bytes": peak,
                    "fixed_bytes": int(fixed_bytes),
                    "step_peak_bytes": int(scale * part),
                    "budget_bytes": budget_bytes,
                    "margin": margin,
                    "headroom_bytes": int(budget_bytes - peak),
                    "calibration": scale,
                    "candidates": tried,
                }
    smallest = min(tried, key=lambda t: t["predicted_peak_bytes"])
    return {
        "fits": False,
        "reason": f"even micro-batch {smallest['micro_batch']} with checkpointing needs "
        f"{smallest['predicted_peak_bytes'] / 2**30:.2f} GiB, over "
        f"{limit / 2**30:.2f} GiB (budget less {margin:.0%} margin)",
        "budget_bytes": budget_bytes,
        "margin": margin,
        "calibration": scale,
        "candidates": tried,
    }
