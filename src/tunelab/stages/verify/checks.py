"""Pure comparisons of verify (values in, values out): fresh predictions against the recorded ones
(`compare_predictions`: every prediction and raw output identical, every score within `atol`),
and the environment against the run's env.json (`compare_env`, `env_message`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tunelab.core.run_parts import EnvDifference, Prediction, RunEnv

# ---------------------------------------------------------------- pure comparisons

SHOWN_MISMATCHES = 10


def _score_diff(recorded: Any, fresh: Any) -> float:
    """Largest absolute difference between two {label: score} maps (inf when keys differ)."""
    if recorded is None and fresh is None:
        return 0.0
    if not isinstance(recorded, Mapping) or not isinstance(fresh, Mapping):
        return math.inf
    if set(recorded) != set(fresh):
        return math.inf
    diffs = [abs(float(recorded[k]) - float(fresh[k])) for k in recorded]
    return max(diffs, default=0.0)


def compare_predictions(
    recorded: Sequence[Mapping[str, Any] | Prediction],
    fresh: Sequence[Mapping[str, Any] | Prediction],
    *,
    atol: float,
) -> dict[str, Any]:
    """Match prediction rows by id: prediction, raw output and correctness must be identical,
    scores (where recorded) within `atol`.

    Returns {n, matched, mismatched, missing, max_score_diff, atol, mismatches: [first few
    {id, field, recorded, fresh}], ok}.
    """
    fresh_by_id = {r.id: r for r in Prediction.rows(fresh, "the fresh predictions")}
    mismatches: list[dict[str, Any]] = []
    missing = []
    max_diff = 0.0
    bad_ids: set[Any] = set()
    for rec in Prediction.rows(recorded, "the recorded predictions"):
        new = fresh_by_id.get(rec.id)
        if new is None:
            missing.append(rec.id)
            bad_ids.add(rec.id)
            continue
        for field in ("prediction", "raw_output", "correct"):
            was, now = getattr(rec, field), getattr(new, field)
            if was != now:
                bad_ids.add(rec.id)
                mismatches.append({"id": rec.id, "field": field, "recorded": was, "fresh": now})
        if "scores" in rec.raw or "scores" in new.raw:
            diff = _score_diff(rec.scores, new.scores)
            max_diff = max(max_diff, diff)
            if diff > atol:
                bad_ids.add(rec.id)
                mismatches.append(
                    {
                        "id": rec.id,
                        "field": "scores",
                        "recorded": rec.scores,
                        "fresh": new.scores,
                        "max_abs_diff": diff,
                    }
                )
    n = len(recorded)
    return {
        "n": n,
        "matched": n - len(bad_ids),
        "mismatched": len(bad_ids),
        "missing": missing[:SHOWN_MISMATCHES],
        "max_score_diff": max_diff if math.isfinite(max_diff) else None,
        "atol": atol,
        "mismatches": mismatches[:SHOWN_MISMATCHES],
        "ok": not bad_ids and n > 0,
    }


# the fields of an environment that change numerics, as compare_env reads them
_ENV_FIELDS: dict[str, Callable[[RunEnv], Any]] = {
    "torch": lambda e: e.torch,
    "backend": lambda e: e.backend,
    "compute_device": lambda e: e.computed_on,
    "cuda": lambda e: e.cuda,
    "rocm": lambda e: e.rocm,
    "devices": lambda e: e.device_names,
    "transformers": lambda e: e.package("transformers"),
    "peft": lambda e: e.package("peft"),
}


def compare_env(recorded: RunEnv | None, current: RunEnv) -> list[dict]:
    """What differs between a run's env.json and this process's environment, among what changes
    numerics: torch, backend, the device computed on, CUDA/ROCm versions, device names, transformers and peft."""
    if recorded is None or not recorded.raw:
        return [{"field": "env.json", "recorded": None, "current": "present"}]
    out = []
    for name, get in _ENV_FIELDS.items():
        a, b = get(recorded), get(current)
        if a != b:
            out.append({"field": name, "recorded": a, "current": b})
    return out


def env_message(run_id: str, differences: Sequence[Mapping[str, Any]]) -> str | None:
    if not differences:
        return None
    found = [EnvDifference.of("the environment", d, "differences") for d in differences]
    what = ", ".join(f"{d.what} {d.recorded} -> {d.current}" for d in found)
    return (
        f"this environment differs from run {run_id}'s ({what}): outputs may legitimately "
        "differ on a new platform; re-run `tunelab smoke` and `tunelab baseline` here before "
        "trusting or comparing results made on it"
    )
