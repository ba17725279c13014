"""Gather everything the dossier shows, from the records only (never from live objects).

Each part is optional: a study that has only reached the data stage still gets a dossier that
says which stages have no record yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunelab.core.study import Study
from tunelab.stages.hypothesis.stage import all_hypotheses
from tunelab.stages.plan.stored import plans_in_order


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    except OSError:
        pass
    return rows


def _records_in(folder: Path, pattern: str = "*.json") -> list[dict[str, Any]]:
    out = []
    if folder.is_dir():
        for p in sorted(folder.glob(pattern)):
            rec = _read(p)
            if isinstance(rec, dict):
                rec.setdefault("_path", str(p))
                out.append(rec)
    return out


def _collect_run(study: Study, row: Any, events: list[dict[str, Any]]) -> dict[str, Any]:
    run_dir = study.runs_dir / row.id
    evaluations = {}
    for p in sorted(run_dir.glob("metrics-*.json")):
        rec = _read(p)
        if isinstance(rec, dict):
            evaluations[p.stem.removeprefix("metrics-")] = rec
    config = _read(run_dir / "config.json") or {}
    return {
        "row": row.to_dict(),
        "config": config,
        "env": _read(run_dir / "env.json"),
        "status": _read(run_dir / "status.json"),
        "audit": _read(run_dir / "audit.json"),
        "steps": _read_jsonl(run_dir / "metrics.jsonl"),
        "evaluations": evaluations,
        "verify": _records_in(run_dir, "verify*.json"),
        "events": events,  # the ledger's, oldest first: statuses (interruptions, resumes), checks
    }


def collect(study: Study) -> dict[str, Any]:
    rec = study.records
    rows = study.list_runs()
    events: dict[str, list[dict[str, Any]]] = {}
    for e in study.ledger.events():
        events.setdefault(e["run_id"], []).append(e)
    runs = [_collect_run(study, r, events.get(r.id, [])) for r in rows]
    data = []
    data_root = rec / "data"
    if data_root.is_dir():
        for d in sorted(data_root.iterdir()):
            m = _read(d / "manifest.json")
            if isinstance(m, dict):
                m["_duplicates"] = _read(d / "duplicates.json")
                data.append(m)
    data.sort(key=lambda m: str(m.get("created_at", "")))
    exports = []
    if (rec / "exports").is_dir():
        for d in sorted((rec / "exports").iterdir()):
            m = _read(d / "tunelab-manifest.json") or _read(d / "manifest.json")
            if isinstance(m, dict):
                m["_path"] = str(d)
                exports.append(m)
    return {
        "study": study.config.name,
        "root": str(study.root),
        "config": study.config.to_dict(),
        "hypotheses": all_hypotheses(rec),
        "data": data,
        "inspections": _records_in(rec / "inspect"),
        "sizing": _records_in(rec / "sizing"),
        "runs": runs,
        "compares": _records_in(rec / "compare"),
        "plans": plans_in_order(study),
        "exports": exports,
        "test_openings": study.ledger.test_openings(),
    }
