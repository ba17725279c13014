"""The dossier's section on the platforms each stage ran on (smoke, baseline, train, eval,
verify): backend, devices, torch, CUDA/ROCm, driver, transformers, peft, extensions.

A platform is `tunelab.core.env.platform_of` of a run's env.json (a train run's resumes add
theirs from platforms.jsonl; a verification names its fresh process's, or, in a record that
predates that field, the verified run's when it found the environment the same). The table
has one column per platform, so that it stays readable at 80 columns (more platforms: more
tables). Runs that trained past the platform gate with an override are listed with the reason,
and evaluations spread over several platforms are pointed out: their paired deltas mix the
numerics of different kernels.
"""

from __future__ import annotations

import json
from typing import Any

from tunelab.core.env import platform_of
from tunelab.core.errors import StudyError
from tunelab.core.record_types import Verify
from tunelab.core.run_parts import PlatformGate
from tunelab.stages.report.collect import RunEvidence
from tunelab.stages.report.document import Section, Value
from tunelab.stages.report.sections.context import Dossier

STAGES = ("smoke", "baseline", "train", "eval", "verify")
FIELDS = (
    ("backend", "compute_device"),
    ("GPUs", "devices"),
    ("torch", "torch"),
    ("CUDA", "cuda"),
    ("ROCm", "rocm"),
    ("driver", "driver"),
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("extensions", "extensions"),
)
WIDTH = 80  # the Markdown table's widest line
CELL = 24  # longer values are shortened (the HTML shows them whole on hover)


def _resumes(d: Dossier, run: RunEvidence) -> list[PlatformGate]:
    """The resumes' gate lines of a train run (platforms.jsonl); unreadable lines are skipped
    (the run's own records say the rest)."""
    path = d.study.runs_dir / run.row.id / "platforms.jsonl"
    if not path.is_file():
        return []
    out = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            gate = PlatformGate.of(path, json.loads(line), f"line {number}")
        except (json.JSONDecodeError, StudyError):
            continue
        if gate.platform is not None:
            out.append(gate)
    return out


def _verify_platform(v: Verify, run: RunEvidence) -> dict[str, Any] | None:
    env = v.environment_check
    if env is None:
        return None
    if env.platform is not None:
        return env.platform
    if env.same and run.env and run.env.raw:
        return platform_of(run.env.raw)
    return None


def stage_platforms(d: Dossier) -> tuple[list[dict[str, Any]], list[str]]:
    """([{platform, runs: {stage: [run id, ...]}}] in order of first use, notes on overrides)."""
    seen: list[dict[str, Any]] = []
    notes: list[str] = []

    def add(platform: dict[str, Any], stage: str, run_id: str) -> None:
        entry = next((e for e in seen if e["platform"] == platform), None)
        if entry is None:
            entry = {"platform": platform, "runs": {}}
            seen.append(entry)
        ids = entry["runs"].setdefault(stage, [])
        if run_id not in ids:
            ids.append(run_id)

    for r in d.runs:
        if r.row.kind in STAGES and r.env and r.env.raw:
            add(platform_of(r.env.raw), r.row.kind, r.row.id)
        gate = r.config.gate if r.config else None
        lines = [gate, *_resumes(d, r)] if r.row.kind == "train" else []
        for line in [g for g in lines if g is not None]:
            if line.command == "resume" and line.platform is not None:
                add(line.platform, "train", r.row.id)
            if (override := line.override) is not None:
                notes.append(
                    f"{r.label} ({line.command or 'train'}) went past the platform gate without "
                    f"{' and '.join(override.missing or ['checks'])} on its "
                    f"platform: {override.why}"
                )
        for v in r.verify:
            if (p := _verify_platform(v, r)) is not None:
                add(p, "verify", r.row.id)
    return seen, notes


def _cell(v: Any) -> Any:
    if isinstance(v, dict):
        v = ", ".join(f"{k} {x}" for k, x in sorted(v.items()))
    elif isinstance(v, list):
        v = ", ".join(map(str, v))
    text = str(v) if v not in (None, "", []) else "-"
    return text if len(text) <= CELL else Value(text[: CELL - 1] + "…", text)


def _runs(ids: list[str]) -> str:
    return "-" if not ids else f"{len(ids)} run" + ("s" if len(ids) > 1 else "")


def _shown(v: Any) -> int:
    return len(v.shown) if isinstance(v, Value) else len(str(v))


def _chunks(columns: list[list[Any]], first: list[str]) -> list[list[int]]:
    """Platform indexes per table, as many per table as fit in WIDTH with the first column."""
    base = 2 + max(len(s) for s in first) + 2
    out: list[list[int]] = [[]]
    width = base
    for i, col in enumerate(columns):
        w = max(_shown(c) for c in col) + 3
        if out[-1] and width + w > WIDTH:
            out.append([])
            width = base
        out[-1].append(i)
        width += w
    return out


def platforms_section(d: Dossier) -> Section | None:
    entries, notes = stage_platforms(d)
    if not entries:
        return None
    sec = Section("Platforms")
    sec.text(
        "The platforms each stage ran on (each run's env.json; a resumed run's platforms.jsonl; "
        "a verification's fresh process). A platform switch re-runs the smoke and the baseline: "
        "`tunelab train` and `tunelab resume` refuse without them, unless overridden with a "
        "reason."
    )
    first = [name for name, _ in FIELDS] + list(STAGES)
    columns = [
        [f"P{i + 1}"]
        + [_cell(e["platform"].get(key)) for _, key in FIELDS]
        + [_runs(e["runs"].get(s, [])) for s in STAGES]
        for i, e in enumerate(entries)
    ]
    for part in _chunks(columns, first):
        rows = [[name] + [columns[i][k + 1] for i in part] for k, name in enumerate(first)]
        sec.table(["", *(columns[i][0] for i in part)], rows)
    evaluated = [e for e in entries if {"baseline", "eval"} & set(e["runs"])]
    if len(evaluated) > 1:
        sec.text(
            f"The baseline and the evaluations ran on {len(evaluated)} platforms: their paired "
            "deltas mix the numerics of different platforms."
        )
    for note in notes:
        sec.text(note)
    return sec
