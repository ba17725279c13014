"""Where each kind of evidence lives in a study folder, and the one rule for "the latest".

`latest(study, kind, ...)` answers "which record of this kind is current?" for every stage that
reads another stage's evidence (the planner reads smoke and baseline, compare reads baselines and
evaluations, export reads verify, ...).

The rule: the latest record of a kind is the newest *finished* one, by the order in which the
records were created, among those whose record file exists.

- Finished: a run kind (smoke, baseline, eval, train, ...) counts only runs the ledger marks
  `completed`; a study-level record (sizing, plan, hypothesis, verify) is finished once its
  file is in place (files are moved into place whole, see core/records).
- Creation order: for runs, the ledger's (created_at, id); for numbered files, the number
  (hypothesis-v<N>, verify-<N>); for sizing, the file name (a UTC stamp); for plans, the
  record's `created_ns` (a plan id carries whole seconds, so two plans of one second tie).
- A run of the kind without the asked record file (a smoke killed before smoke.json) is
  passed over for the next newest; a record file that exists but cannot be read raises
  the located `StudyError` of `records.read_json`, never a silent fall back to an older record.
- An evaluation of a run is its newest completed `eval` child with metrics on the split, else
  the run's own metrics (a baseline evaluates itself). The latest baseline is the newest
  completed baseline that has an evaluation on the split: compare, the planner and the report
  all set variants against this one.
- Data snapshots are content-addressed folders that a later `tunelab data` may choose again,
  so the latest snapshot is the one the last `data:snapshot` ledger event chose (when its
  folder is present), else the newest manifest's `created_at`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import HypothesisError
from tunelab.core.hashing import sha256_json
from tunelab.core.record_types import Hypothesis
from tunelab.core.records import read_json

if TYPE_CHECKING:
    from tunelab.core.ledger import RunRow
    from tunelab.core.study import Study

__all__ = [
    "BASELINE_KIND",
    "EVAL_KIND",
    "Latest",
    "all_hypotheses",
    "find_evaluation",
    "latest",
    "latest_baseline",
    "latest_hypothesis",
    "latest_numbered",
    "latest_snapshot_id",
    "pinned_commit",
    "pins_of",
    "read_hypothesis",
    "sizing_dir",
]

EVAL_KIND = "eval"
BASELINE_KIND = "baseline"


@dataclass(frozen=True)
class Latest:
    """The latest record of a kind: where it is and, for a run kind, the run's ledger row."""

    path: Path
    row: RunRow | None = None

    @property
    def run_id(self) -> str | None:
        return self.row.id if self.row else None

    def read(self) -> Any:
        """The record's JSON (a damaged record raises the located StudyError)."""
        return read_json(self.path)


def sizing_dir(study: Study) -> Path:
    return study.records / "sizing"


def _number(path: Path) -> int | None:
    m = re.search(r"(\d+)\.json$", path.name)
    return int(m.group(1)) if m else None


def latest_numbered(folder: Path, prefix: str) -> Path | None:
    """The `<prefix><N>.json` file in `folder` with the highest N, or None."""
    found = [(n, p) for p in Path(folder).glob(f"{prefix}*.json") if (n := _number(p)) is not None]
    return max(found)[1] if found else None


def _latest_run(
    study: Study,
    kind: str,
    record: str,
    parent: str | None,
    where: Callable[[RunRow], bool] | None,
) -> Latest | None:
    rows = [r for r in study.ledger.list_runs(kind) if r.status == "completed"]
    if parent is not None:
        rows = [r for r in rows if r.parent == parent]
    for row in reversed(rows):  # the ledger lists runs by (created_at, id)
        path = study.runs_dir / row.id / record
        if path.exists() and (where is None or where(row)):
            return Latest(path, row)
    return None


def _latest_plan(study: Study) -> Latest | None:
    def created(path: Path) -> tuple[int, str]:
        rec = read_json(path)
        return (int(rec.get("created_ns") or 0), str(rec.get("id", "")))

    found = sorted((study.records / "plans").glob("plan-*.json"))
    return Latest(max(found, key=created)) if found else None


def latest(
    study: Study,
    kind: str,
    record: str | None = None,
    *,
    parent: str | None = None,
    run_dir: Path | None = None,
    where: Callable[[RunRow], bool] | None = None,
) -> Latest | None:
    """The latest record of `kind` by the module's rule, or None when there is none.

    Args:
        kind: a run kind ("smoke", "baseline", "eval", "train", ...) or a study-level record
            kind: "sizing", "plan", "hypothesis", or "verify" (with `run_dir`).
        record: for a run kind, the file inside the run folder that must exist
            (e.g. "smoke.json", "metrics-validation.json").
        parent: for a run kind, only runs whose parent is this run id.
        where: for a run kind, a further test the run's ledger row must pass.

    Raises:
        StudyError: a record that decides the order (a plan) is damaged.
    """
    if kind == "sizing":
        found = sorted(sizing_dir(study).glob("size-*.json"), key=lambda p: p.name)
        return Latest(found[-1]) if found else None
    if kind == "plan":
        return _latest_plan(study)
    if kind == "hypothesis":
        path = latest_numbered(study.records, "hypothesis-v")
        return Latest(path) if path else None
    if kind == "verify":
        assert run_dir is not None, "latest(study, 'verify') needs run_dir"
        path = latest_numbered(run_dir, "verify-")
        return Latest(path) if path else None
    assert record is not None, f"latest(study, {kind!r}) of a run kind needs the record file"
    return _latest_run(study, kind, record, parent, where)


def latest_snapshot_id(study: Study) -> str | None:
    """The snapshot the last `tunelab data` chose (ledger), else the newest on disk."""
    root = study.records / "data"
    present = (
        {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
        if root.is_dir()
        else set()
    )
    for event in reversed(study.ledger.events()):
        if event.kind == "data:snapshot":
            sid = event.detail_object().get("snapshot_id")
            if sid in present:
                return sid
    best: tuple[str, str] | None = None
    for sid in present:
        try:
            created = read_json(root / sid / "manifest.json")["created_at"]
        except Exception:  # noqa: BLE001 - a folder without a readable manifest is unfinished
            continue
        if best is None or created > best[0]:
            best = (created, sid)
    return best[1] if best else None


def find_evaluation(study: Study, run_id: str, split: str = "validation") -> dict[str, Any] | None:
    """The evaluation of run `run_id` on `split`: the newest completed `eval` run of it, else
    the run's own metrics (a baseline, or a run that evaluated itself). Returns {"eval_run",
    "dir", "record"} or None."""
    name = f"metrics-{split}.json"
    found = latest(study, EVAL_KIND, name, parent=run_id)
    path = found.path if found else study.runs_dir / run_id / name
    if not path.exists():
        return None
    return {"eval_run": path.parent.name, "dir": path.parent, "record": read_json(path)}


def latest_baseline(
    study: Study, split: str = "validation"
) -> tuple[RunRow, dict[str, Any]] | None:
    """The latest baseline (module rule) and its evaluation on `split` (as `find_evaluation`),
    or None when no completed baseline was evaluated on it."""
    for row in reversed(study.ledger.list_runs(BASELINE_KIND)):
        if row.status != "completed":
            continue
        evaluation = find_evaluation(study, row.id, split)
        if evaluation is not None:
            return row, evaluation
    return None


# ---------------------------------------------------------------- hypotheses

_VERSION_RE = re.compile(r"^hypothesis-v(\d+)\.json$")


def _versions(records: Path) -> list[tuple[int, Path]]:
    out = []
    for p in records.glob("hypothesis-v*.json"):
        m = _VERSION_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_hypothesis(path: Path) -> Hypothesis:
    """A hypothesis record, refused when its locked content no longer matches its sha256."""
    record = read_json(path)
    if not isinstance(record, dict) or sha256_json(record.get("content")) != record.get("sha256"):
        raise HypothesisError(
            f"{path}: edited after registration (its content no longer matches its sha256)",
            hint="restore the file from a copy; to change the hypothesis, edit study.yaml and run "
            "`tunelab register` (a new version)",
        )
    return Hypothesis.of(path, record)


def latest_hypothesis(records: Path) -> Hypothesis | None:
    """The latest registered hypothesis (module rule), checked against its sha256, or None."""
    path = latest_numbered(records, "hypothesis-v")
    return read_hypothesis(path) if path else None


def all_hypotheses(records: Path) -> list[Hypothesis]:
    return [read_hypothesis(p) for _, p in _versions(records)]


def pins_of(study_root: Path) -> dict[str, dict[str, Any]]:
    """The pins of the latest registered hypothesis ({} when none)."""
    latest = latest_hypothesis(Path(study_root) / "records")
    return {key: pin.raw for key, pin in latest.pins.items()} if latest else {}


def pinned_commit(study_root: Path, key: str, repo_id: str) -> str | None:
    """The commit pinned for `key` ("model" | "data") when it pins `repo_id`, else None."""
    latest = latest_hypothesis(Path(study_root) / "records")
    pin = latest.pins.get(key) if latest else None
    return pin.commit if pin and pin.repo_id == repo_id else None
