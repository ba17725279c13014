"""The platform gate: training starts only on a platform where a smoke passed.

A smoke that passed on a laptop CPU says nothing about a rented CUDA or ROCm box (another
torch, kernels, precision). Each smoke and baseline records its env.json; `platforms_of`
lists the platforms a stage passed on, and `require_smoke_platform` refuses `train` and
`resume` on a platform without a passing smoke there, unless the user overrides it with a
reason that the run records.
"""

from __future__ import annotations

from typing import Any

from tunelab.core.env import describe_platform, platform_of
from tunelab.core.errors import RunError
from tunelab.core.records import read_json
from tunelab.core.study import Study


def platforms_of(study: Study, kind: str) -> list[dict[str, Any]]:
    """The distinct platforms completed `kind` runs (smoke, baseline, train) ran on, oldest
    first, each with the runs that ran there: [{platform, runs: [id, ...]}]."""
    out: list[dict[str, Any]] = []
    for row in study.ledger.list_runs(kind):
        env_path = study.runs_dir / row.id / "env.json"
        if row.status != "completed" or not env_path.is_file():
            continue
        platform = platform_of(read_json(env_path))
        for seen in out:
            if seen["platform"] == platform:
                seen["runs"].append(row.id)
                break
        else:
            out.append({"platform": platform, "runs": [row.id]})
    return out


def _passed_smokes(study: Study) -> list[dict[str, Any]]:
    passed = []
    for entry in platforms_of(study, "smoke"):
        runs = [
            r
            for r in entry["runs"]
            if (study.runs_dir / r / "smoke.json").is_file()
            and read_json(study.runs_dir / r / "smoke.json").get("passed")
        ]
        if runs:
            passed.append({**entry, "runs": runs})
    return passed


def require_smoke_platform(
    study: Study, command: str, override_why: str | None
) -> dict[str, Any] | None:
    """Refuse `command` (train, resume) when smokes passed in this study but none on this
    platform; returns the override's record when `override_why` lets it go on (else None)."""
    from tunelab.core.env import capture_env

    passed = _passed_smokes(study)
    if not passed:
        return None
    here = platform_of(capture_env())
    if any(entry["platform"] == here for entry in passed):
        return None
    if override_why:
        return {
            "why": override_why,
            "platform": here,
            "smoke_platforms": [e["platform"] for e in passed],
        }
    last = passed[-1]
    diff = ", ".join(
        f"{k} {last['platform'][k]} -> {here[k]}"
        for k in here
        if here[k] != last["platform"].get(k)
    )
    raise RunError(
        f"no smoke passed on this platform ({describe_platform(here)}); smoke "
        f"{last['runs'][-1]} passed on another ({diff})",
        hint=f"run `tunelab smoke -s {study.root}` here first (a platform switch re-runs the "
        f"start-up checks), or `tunelab {command} --other-platform --why TEXT` to go on, the "
        "reason recorded",
    )
