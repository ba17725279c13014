"""The platform gate: training starts only on a platform where a smoke and a baseline passed.

A smoke or a baseline that passed on a laptop CPU says nothing about a rented CUDA or ROCm box
(another torch, kernels, precision, numerics): a platform switch re-runs the start-up check
(`tunelab smoke`) and the quality check (`tunelab baseline`). Each run records its env.json;
`platforms_of` lists the platforms a stage's completed runs ran on, and `check_platform`
refuses `train` and `resume` on a platform without a passing smoke and a completed baseline
there, naming the commands that fix it, unless the user overrides it with a reason.

The reason comes from `--other-platform --why TEXT` or from the environment variable
`TUNELAB_PLATFORM_WHY` (for pipelines that run stages on their own, the test suite among them);
either way the run records it. What the gate found is the run's `platform_gate` (config.json
for a new run, one line of `platforms.jsonl` per resume): the platform, the smoke and the
baseline that passed on it, or the override.
"""

from __future__ import annotations

import os
from typing import Any

from tunelab.core.env import capture_env, describe_platform, platform_of
from tunelab.core.errors import RunError
from tunelab.core.record_types import Smoke
from tunelab.core.records import read_json
from tunelab.core.study import Study

WHY_ENV = "TUNELAB_PLATFORM_WHY"
# the checks a platform switch re-runs, in the order they are run
GATED = ("smoke", "baseline")


def platforms_of(study: Study, kind: str) -> list[dict[str, Any]]:
    """The distinct platforms completed `kind` runs (smoke, baseline, train, eval) ran on,
    oldest first, each with the runs that ran there: [{platform, runs: [id, ...]}]."""
    out: list[dict[str, Any]] = []
    for row in study.ledger.list_runs(kind):
        env_path = study.runs_dir / row.id / "env.json"
        if row.status != "completed" or not env_path.is_file():
            continue
        add_platform(out, platform_of(read_json(env_path)), row.id)
    return out


def add_platform(entries: list[dict[str, Any]], platform: dict[str, Any], run_id: str) -> None:
    """Add `run_id` to the entry of `platform` in `entries` (a new entry when unseen)."""
    for seen in entries:
        if seen["platform"] == platform:
            if run_id not in seen["runs"]:
                seen["runs"].append(run_id)
            return
    entries.append({"platform": platform, "runs": [run_id]})


def passed_platforms(study: Study, kind: str) -> list[dict[str, Any]]:
    """`platforms_of` keeping the runs that passed: a smoke whose smoke.json says so, a
    completed baseline."""
    if kind != "smoke":
        return platforms_of(study, kind)
    passed = []
    for entry in platforms_of(study, kind):
        runs = [
            r
            for r in entry["runs"]
            if (study.runs_dir / r / "smoke.json").is_file()
            and Smoke.read(study.runs_dir / r / "smoke.json").passed
        ]
        if runs:
            passed.append({**entry, "runs": runs})
    return passed


def _missing_line(kind: str, passed: list[dict[str, Any]], here: dict[str, Any]) -> str:
    if not passed:
        return f"no {kind} passed in this study"
    last = passed[-1]
    diff = ", ".join(
        f"{k} {last['platform'].get(k)} -> {here[k]}"
        for k in here
        if here[k] != last["platform"].get(k)
    )
    return (
        f"no {kind} passed on this platform; {kind} {last['runs'][-1]} passed on another ({diff})"
    )


def check_platform(study: Study, command: str, override_why: str | None) -> dict[str, Any]:
    """The gate of `command` (train, resume) on this platform: {platform, smoke, baseline}
    (the runs that passed here), with `override` {why, source, missing} where the user let
    it go on without them. Raises RunError naming `tunelab smoke` / `tunelab baseline` when
    one is missing here and no reason is given."""
    here = platform_of(capture_env())
    record: dict[str, Any] = {"platform": here}
    missing: dict[str, list[dict[str, Any]]] = {}
    for kind in GATED:
        passed = passed_platforms(study, kind)
        match = [e for e in passed if e["platform"] == here]
        record[kind] = match[0]["runs"][-1] if match else None
        if not match:
            missing[kind] = passed
    if not missing:
        return record
    why, source = override_why, "--why"
    if not (why and why.strip()):
        why, source = os.environ.get(WHY_ENV, "").strip(), WHY_ENV
    if why:
        record["override"] = {
            "why": why,
            "source": source,
            "missing": {k: [e["platform"] for e in v] for k, v in missing.items()},
        }
        return record
    lines = "; ".join(_missing_line(k, v, here) for k, v in missing.items())
    fixes = " and ".join(f"`tunelab {k} -s {study.root}`" for k in missing)
    raise RunError(
        f"{command} needs a passing smoke and baseline on this platform "
        f"({describe_platform(here)}): {lines}",
        hint=f"run {fixes} here first (a platform switch re-runs the start-up and quality "
        f"checks), or `tunelab {command} --other-platform --why TEXT` to go on, the reason "
        "recorded",
    )
