"""The records of a study as what a tracker takes: flat params, tags, metric points and files.

Pure functions take record dicts and return values; `collect_study(study)` reads the study
folder once and builds one `RunMirror` per tunelab run (plus one for the study's own records).

`collect_study(study) -> [RunMirror]` (every run of `study.list_runs()`, oldest first, then the
`study` mirror of the records of no run); `RunMirror(run_id, kind, name, status, reason,
start_ms, end_ms, nest_under, params, tags, points: [Point(key, value, step, timestamp_ms)],
files: [(path, artifact folder)])`, `fingerprint()`. `STEP_KEYS` maps metrics.jsonl fields to
tracker keys (`loss` -> `train/loss`, `val_loss` -> `validation/loss`, `memory_bytes` ->
`system/memory_bytes`, ...); evaluation records become `<split>/<metric>` (per category and
field flattened), smoke.json numbers `smoke/<name>`. `flatten_params`, `step_points(row,
ts_ms)`, `evaluation_points`, `metric_key`, `env_summary`, `run_tags` are pure; no tracker is
imported here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import StudyError
from tunelab.core.hashing import sha256_file, sha256_json
from tunelab.core.record_parts import RunEnv
from tunelab.core.record_types import Compare, Evaluation, RunConfig, Smoke

if TYPE_CHECKING:
    from tunelab.core.study import Study

# metrics.jsonl fields -> tracker keys; one naming for the MLflow mirror and TensorBoard
STEP_KEYS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "tokens": "train/tokens",
    "loss_tokens": "train/loss_tokens",
    "seconds": "train/step_s",
    "epoch": "train/epoch",
    "val_loss": "validation/loss",
    "val_tokens": "validation/loss_tokens",
    "memory_bytes": "system/memory_bytes",
    "elapsed_s": "system/elapsed_s",
}
STUDY_RUN_ID = "study"  # the mirror of the records that belong to no run
# files of a run folder that are state, not records
SKIPPED_FILES = {"DONE"}
_KEY_CHARS = re.compile(r"[^\w.\- :/]")


@dataclass
class Point:
    key: str
    value: float
    step: int
    timestamp_ms: int
    curve: bool = True  # a step of metrics.jsonl; False: an evaluation or smoke value, its
    # step the number of the evaluation (a tracker without step-free values logs it apart)


@dataclass
class RunMirror:
    """One tunelab run as a tracker sees it."""

    run_id: str
    kind: str
    name: str
    status: str
    reason: str | None
    start_ms: int
    end_ms: int | None
    nest_under: str | None = None  # the run an evaluation evaluates
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    files: list[tuple[Path, str]] = field(default_factory=list)  # (file, artifact folder)

    def fingerprint(self) -> str:
        """sha256 of everything mirrored: equal fingerprints mean nothing to send."""
        return sha256_json(
            {
                "run": [self.kind, self.name, self.status, self.reason, self.end_ms],
                "params": self.params,
                "tags": self.tags,
                "points": [[p.key, p.value, p.step] for p in self.points],
                "files": [[str(f), folder, sha256_file(f)] for f, folder in self.files],
                "nest_under": self.nest_under,
            }
        )


# ------------------------------------------------------------------ pure flattening


def metric_key(*parts: str) -> str:
    """A tracker key from parts: characters trackers refuse (MLflow keeps letters, digits,
    `_ - . : /` and spaces) become `_`."""
    return "/".join(_KEY_CHARS.sub("_", str(p)) for p in parts if p != "")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"training": {"lr": 2e-4}} -> {"training.lr": "0.0002"}: nested mappings become dotted
    keys, lists and scalars their JSON text (strings as they are)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = _KEY_CHARS.sub("_", f"{prefix}{key}")
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, f"{name}."))
        else:
            out[name] = _text(value)
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def step_points(row: dict[str, Any], timestamp_ms: int) -> list[Point]:
    """One metrics.jsonl line as points at its step; unknown numeric fields go under train/."""
    step = int(row.get("step", 0))
    points = []
    for name, value in row.items():
        number = _number(value)
        if name == "step" or number is None:
            continue
        points.append(
            Point(STEP_KEYS.get(name) or metric_key("train", name), number, step, timestamp_ms)
        )
    return points


def numeric_leaves(tree: dict[str, Any], *prefix: str) -> list[tuple[str, float]]:
    """(key, value) for every number in nested mappings; lists (a confusion matrix) are left
    to the record file."""
    out = []
    for name, value in tree.items():
        if isinstance(value, dict):
            out.extend(numeric_leaves(value, *prefix, name))
        elif (number := _number(value)) is not None:
            out.append((metric_key(*prefix, name), number))
    return out


def evaluation_points(record: Evaluation, step: int, timestamp_ms: int) -> list[Point]:
    """A metrics-<split>.json record as `<split>/<metric>` points (per category and per field
    included, the confusion matrix left out), with its size and speed."""
    split = record.split or "evaluation"
    metrics = {k: v for k, v in record.metrics.items() if k != "confusion"}
    leaves = numeric_leaves(metrics, split)
    for name, value in (("seconds", record.seconds), ("examples_per_s", record.examples_per_s)):
        if (number := _number(value)) is not None:
            leaves.append((metric_key(split, name), number))
    return [Point(k, v, step, timestamp_ms, curve=False) for k, v in leaves]


def env_summary(env: RunEnv) -> str:
    """One line: python, torch, the device (GPU names or CPU cores) and the key libraries."""
    if env.devices:
        names: dict[str, int] = {}
        for name in (g.name or "?" for g in env.devices):
            names[name] = names.get(name, 0) + 1
        device = ", ".join(f"{n}x {name}" for name, n in names.items())
    else:
        cores = env.logical_cores
        device = f"cpu ({cores} cores)" if cores else "cpu"
    packages = env.packages or {}
    libs = ", ".join(f"{p} {packages[p]}" for p in ("transformers", "peft") if packages.get(p))
    parts = [f"python {env.python or '?'}", f"torch {env.torch or '?'}", device, libs]
    if env.cuda:
        parts.append(f"cuda {env.cuda}")
    return ", ".join(p for p in parts if p)


def _ms(stamp: str | None) -> int | None:
    if not stamp:
        return None
    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)


def run_tags(record: RunConfig, row: Any, env: RunEnv | None) -> dict[str, str]:
    """Tags of a run from its config.json, its ledger row and env.json (absent values left out)."""
    base = record.base
    tags = {
        "tunelab.run_id": row.id,
        "tunelab.kind": row.kind,
        "tunelab.name": row.name,
        "tunelab.parent": row.parent,
        "tunelab.why": row.why,
        "tunelab.status": row.status,
        "tunelab.reason": row.reason,
        "tunelab.created_at": row.created_at,
        "tunelab.finished_at": row.finished_at,
        "tunelab.config_sha256": record.config_sha256,
        "tunelab.overrides": _text(record.overrides) if record.overrides else None,
        "tunelab.hypothesis_version": record.hypothesis_version,
        "tunelab.hypothesis_sha256": record.hypothesis_sha256,
        "tunelab.data_snapshot": record.data_snapshot,
        "tunelab.eval_spec_sha256": record.evaluation_spec_sha256
        or record.hypothesis_evaluation_spec_sha256,
        "tunelab.split": record.split,
        "tunelab.evaluates": record.evaluates,
        "tunelab.base.name": base.name,
        "tunelab.base.revision": base.revision,
        "tunelab.base.repo_id": base.hub_pin.repo_id,  # a base pinned to a hub commit
        "tunelab.base.commit": base.hub_pin.commit,
        "tunelab.base.sha256": base.sha256,
        "tunelab.base.architecture": base.architecture,
    }
    if env:
        tags.update(
            {
                "tunelab.core.env": env_summary(env),
                "tunelab.core.env.torch": env.torch,
                "tunelab.core.env.device": env.compute_device or env.backend,
                "tunelab.core.env.cuda": env.cuda,
                "tunelab.core.env.driver": env.driver,
                "tunelab.git_commit": env.git_commit,
            }
        )
    tags["mlflow.note.content"] = describe_run(row)
    return {k: str(v) for k, v in tags.items() if v is not None and v != ""}


def describe_run(row: Any) -> str:
    """The run's description in a tracker (Markdown): what it changes, how it ended."""
    lines = [f"tunelab {row.kind} run `{row.id}`"]
    if row.why:
        lines.append(f"**Why:** {row.why}")
    lines.append(f"**Status:** {row.status}" + (f": {row.reason}" if row.reason else ""))
    if row.parent:
        lines.append(f"**Parent:** `{row.parent}`")
    return "\n\n".join(lines)


# ------------------------------------------------------------------ reading a study


def _run_files(run_dir: Path) -> list[tuple[Path, str]]:
    """The run's record files (not its checkpoints or event files) for the `records` folder."""
    return [
        (p, "records")
        for p in sorted(run_dir.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.name not in SKIPPED_FILES
    ]


def step_rows(path: Path, running: bool) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl; a running run's last line may be half written and is
    left for the next sync, anywhere else a broken line is a damaged record."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if running and number == len(lines):
                break
            raise StudyError(
                f"{path}:{number}: not valid JSON: the record is damaged",
                hint="restore it from a copy; records are never rewritten by tunelab",
            ) from None
    return rows


def _evaluations(study: Study, row: Any, rows: list[Any]) -> list[tuple[Evaluation, Any]]:
    """(record, created_at) of each evaluation of `row`: its own metrics-<split>.json files,
    then those of its completed `eval` runs, oldest first."""
    found = []
    for path in sorted((study.runs_dir / row.id).glob("metrics-*.json")):
        found.append((Evaluation.read(path), row.created_at))
    for other in rows:
        if other.kind == "eval" and other.parent == row.id and other.status == "completed":
            for path in sorted((study.runs_dir / other.id).glob("metrics-*.json")):
                found.append((Evaluation.read(path), other.created_at))
    return found


def _compares(study: Study) -> list[Compare]:
    return [Compare.read(p) for p in sorted((study.records / "compare").glob("*.json"))]


def _compare_tags(row: Any, compares: list[Compare]) -> dict[str, str]:
    """The guardrail verdict and decision of the run's last comparison."""
    entries = [e for c in compares for e in c.runs if e.run_id == row.id and e.compared]
    if not entries:
        return {}
    last = entries[-1]
    tags = {"tunelab.stages.compare.guardrails": last.guardrails_outcome}
    if last.decision:
        tags["tunelab.stages.compare.decision"] = last.decision
    return tags


def mirror_run(
    study: Study, row: Any, rows: list[Any], compares: list[Compare], points: bool = True
) -> RunMirror:
    """The mirror of one run from its folder, its ledger row, its evaluations and the
    comparisons that list it; `points=False` leaves out its metrics (a live logger reads no
    metrics.jsonl that the run is appending to)."""
    run_dir = study.runs_dir / row.id
    record = RunConfig.read(run_dir / "config.json")
    env_path = run_dir / "env.json"
    env = RunEnv.read(env_path) if env_path.exists() else None
    start = _ms(row.created_at) or 0
    mirror = RunMirror(
        run_id=row.id,
        kind=row.kind,
        name=row.name or row.id,
        status=row.status,
        reason=row.reason,
        start_ms=start,
        end_ms=_ms(row.finished_at),
        nest_under=row.parent if row.kind == "eval" else None,
        params=flatten_params(record.config),
        tags=run_tags(record, row, env),
        files=_run_files(run_dir),
    )
    metrics_path = run_dir / "metrics.jsonl"
    for r in step_rows(metrics_path, row.status == "running") if points else []:
        mirror.points += step_points(r, start + int(1000 * (r.get("elapsed_s") or 0)))
    per_split: dict[str, int] = {}
    for rec, created in _evaluations(study, row, rows):
        split = rec.split or "evaluation"
        step = per_split[split] = per_split.get(split, -1) + 1
        mirror.points += evaluation_points(rec, step, _ms(created) or start)
    smoke = run_dir / "smoke.json"
    if smoke.exists():
        record = Smoke.read(smoke)
        mirror.points += [
            Point(metric_key("smoke", k), v, 0, start, curve=False)
            for k, v in numeric_leaves(record.numbers())
        ]
        mirror.tags["tunelab.smoke_passed"] = str(record.passed)
    mirror.files += [(c.path, "compare") for c in compares if c.lists(row.id)]
    mirror.tags.update(_compare_tags(row, compares))
    return mirror


def mirror_study_records(study: Study, rows: list[Any]) -> RunMirror:
    """The records that belong to the study, not to one run: hypotheses, comparisons, data
    manifests, plans and the dossier."""
    records, report = study.records, study.root / "report"
    files = [(p, "hypothesis") for p in sorted(records.glob("hypothesis-v*.json"))]
    files += [(p, "compare") for p in sorted((records / "compare").glob("*.json"))]
    for snap in sorted((records / "data").glob("*/manifest.json")):
        files += [
            (p, f"data/{snap.parent.name}")
            for p in (snap, snap.parent / "duplicates.json")
            if p.exists()
        ]
    for folder in ("plans", "sizing"):
        files += [(p, folder) for p in sorted((records / folder).glob("*")) if p.is_file()]
    files += [(p, "report") for p in sorted(report.glob("dossier.*"))]
    files += [(p, "report/plots") for p in sorted((report / "plots").glob("*.png"))]
    cfg = study.config
    created = min((r.created_at for r in rows), default=None)
    tags = {
        "tunelab.run_id": STUDY_RUN_ID,
        "tunelab.kind": STUDY_RUN_ID,
        "tunelab.core.study": cfg.name,
        "tunelab.study_root": str(study.root),
        "tunelab.task": cfg.task.kind,
        "tunelab.primary_metric": cfg.hypothesis.primary_metric,
        "tunelab.runs": str(len(rows)),
        "mlflow.note.content": describe_study(study),
    }
    return RunMirror(
        run_id=STUDY_RUN_ID,
        kind=STUDY_RUN_ID,
        name=f"study: {cfg.name}",
        status="completed",
        reason=None,
        start_ms=_ms(created) or 0,
        end_ms=_ms(created) or 0,
        tags=tags,
        files=files,
    )


def describe_study(study: Study) -> str:
    """The experiment's description (Markdown): the question and where the evidence lives."""
    cfg = study.config
    h = cfg.hypothesis
    lines = [
        f"tunelab study **{cfg.name}** ({cfg.task.kind})",
        f"**Behaviour:** {h.behaviour}",
        f"**Primary metric:** {h.primary_metric} (at least {h.min_improvement:+g} over the "
        "baseline)",
        "**Guardrails:** " + "; ".join(g.describe() for g in cfg.guardrails),
        f"The records in `{study.root}` are the evidence; this experiment is a copy of them "
        "(`tunelab track` rebuilds it).",
    ]
    return "\n\n".join(lines)


def collect_study(study: Study) -> list[RunMirror]:
    """Every run of the study (oldest first, so a run comes after the run it nests under),
    then the study's own records."""
    rows = study.list_runs()
    compares = _compares(study)
    mirrors = [mirror_run(study, row, rows, compares) for row in rows]
    return [*mirrors, mirror_study_records(study, rows)]


def run_result(mirror: Any, result: dict[str, Any]) -> dict[str, Any]:
    """One mirrored run as a tracker's sync reports it: the tunelab run and what was done."""
    return {
        "run_id": mirror.run_id,
        "kind": mirror.kind,
        "name": mirror.name,
        "status": mirror.status,
        "reason": mirror.reason,
        **result,
    }


def action_counts(results: list[dict[str, Any]]) -> dict[str, int]:
    """How many runs a sync created, updated and left unchanged."""
    return {a: sum(r["action"] == a for r in results) for a in ("created", "updated", "unchanged")}
