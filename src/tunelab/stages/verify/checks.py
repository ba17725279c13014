"""Pure comparisons of verify (values in, values out): fresh predictions against the recorded ones
(`compare_predictions`: every prediction and raw output identical, every score within `atol`),
and the environment against the run's env.json (`compare_env`, `env_message`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

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
    recorded: Sequence[Mapping[str, Any]],
    fresh: Sequence[Mapping[str, Any]],
    *,
    atol: float,
) -> dict[str, Any]:
    """Match prediction rows by id: prediction, raw output and correctness must be identical,
    scores (where recorded) within `atol`.

    Returns {n, matched, mismatched, missing, max_score_diff, atol, mismatches: [first few
    {id, field, recorded, fresh}], ok}.
    """
    fresh_by_id = {r["id"]: r for r in fresh}
    mismatches: list[dict[str, Any]] = []
    missing = []
    max_diff = 0.0
    bad_ids: set[Any] = set()
    for rec in recorded:
        new = fresh_by_id.get(rec["id"])
        if new is None:
            missing.append(rec["id"])
            bad_ids.add(rec["id"])
            continue
        for field in ("prediction", "raw_output", "correct"):
            if rec.get(field) != new.get(field):
                bad_ids.add(rec["id"])
                mismatches.append(
                    {
                        "id": rec["id"],
                        "field": field,
                        "recorded": rec.get(field),
                        "fresh": new.get(field),
                    }
                )
        if "scores" in rec or "scores" in new:
            diff = _score_diff(rec.get("scores"), new.get("scores"))
            max_diff = max(max_diff, diff)
            if diff > atol:
                bad_ids.add(rec["id"])
                mismatches.append(
                    {
                        "id": rec["id"],
                        "field": "scores",
                        "recorded": rec.get("scores"),
                        "fresh": new.get("scores"),
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


def env_devices(env: Mapping[str, Any]) -> list[str]:
    gpus = env.get("gpus") or []
    if gpus:
        return [str(g.get("name")) for g in gpus]
    return [str((env.get("cpu") or {}).get("name"))]


def compare_env(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[dict]:
    """What differs between a run's env.json and this process's environment, among what changes
    numerics: torch, backend, the device computed on, CUDA/ROCm versions, device names, transformers and peft."""
    if not recorded:
        return [{"field": "env.json", "recorded": None, "current": "present"}]

    def pkg(env: Mapping[str, Any], name: str) -> Any:
        return (env.get("packages") or {}).get(name)

    fields = {
        "torch": lambda e: e.get("torch"),
        "backend": lambda e: e.get("backend"),
        # a record without compute_device computed where its backend was
        "compute_device": lambda e: e.get("compute_device", e.get("backend")),
        "cuda": lambda e: e.get("cuda"),
        "rocm": lambda e: e.get("rocm"),
        "devices": env_devices,
        "transformers": lambda e: pkg(e, "transformers"),
        "peft": lambda e: pkg(e, "peft"),
    }
    out = []
    for name, get in fields.items():
        a, b = get(recorded), get(current)
        if a != b:
            out.append({"field": name, "recorded": a, "current": b})
    return out


def env_message(run_id: str, differences: Sequence[Mapping[str, Any]]) -> str | None:
    if not differences:
        return None
    what = ", ".join(f"{d['field']} {d['recorded']} -> {d['current']}" for d in differences)
    return (
        f"this environment differs from run {run_id}'s ({what}): outputs may legitimately "
        "differ on a new platform; re-run `tunelab smoke` and `tunelab baseline` here before "
        "trusting or comparing results made on it"
    )
