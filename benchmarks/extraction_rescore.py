"""Rescore an extraction study's recorded predictions with the current rules, beside the
verdicts they were recorded with.

    python benchmarks/extraction_rescore.py STUDY_DIR [RUN_ID ...] [--json]

For each run (default: every run with a validation evaluation) the scorer is fed the recorded
gold objects and raw outputs, nothing else (it is pure: no model runs). Prints the answers the
recorded verdicts judged not JSON against the current reader's count, the kinds of what is still
unread, and every flat field whose verdict moved (presence, exact, match), with why. The
recorded verdicts are the peer: the same figures come out when they were made by these rules.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def _closes_with_stray_fence(raw: str) -> bool:
    """`{...}` followed by ``` with no fence opened before the object."""
    text = raw.strip()
    start = text.find("{")
    return text.endswith("```") and start >= 0 and "```" not in text[:start]


def _old_field(verdicts: dict[str, Any], field: str) -> tuple[bool, bool, bool] | None:
    """(present, exact, match) of a field in verdicts recorded with per-field dicts."""
    if "presence" not in verdicts:
        return None
    return (
        bool(verdicts["presence"].get(field)),
        bool(verdicts["exact"].get(field)),
        bool(verdicts["normalized"].get(field)),
    )


def _new_field(verdicts: dict[str, Any], field: str) -> tuple[bool, bool, bool]:
    c = (verdicts.get("paths") or {}).get(field) or {}
    return bool(c.get("present")), bool(c.get("exact")), bool(c.get("match"))


def _why(row: dict[str, Any], new: dict[str, Any], field: str) -> str:
    if not row["verdicts"].get("json_valid") and new["verdicts"]["json_valid"]:
        return (
            "read now (a stray closing fence)"
            if _closes_with_stray_fence(row["raw_output"])
            else "read now"
        )
    kind = next(
        (
            k
            for k in ("missing", "wrong_type", "not_json")
            if new["verdicts"]["paths"][field].get(k)
        ),
        None,
    )
    answer = new.get("prediction")
    value = answer.get(field) if isinstance(answer, dict) else None
    if kind == "not_json":
        return f"not JSON ({new['verdicts']['json_failure']}), gold {row['gold'].get(field)!r}"
    if kind == "missing":
        return f"key missing, gold {row['gold'].get(field)!r}"
    if kind == "wrong_type":
        return f"type: answer {value!r}, gold {row['gold'].get(field)!r}"
    return f"answer {value!r}, gold {row['gold'].get(field)!r}"


def rescore_run(study: Any, run_id: str) -> dict[str, Any] | None:
    from tunelab.core.evidence import find_evaluation
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.predict import rescore_predictions
    from tunelab.stages.evaluate.stage import compute_metrics, load_predictions

    found = find_evaluation(study, run_id, "validation")
    if found is None or found["record"].get("task_kind") != "extraction":
        return None
    task = get_task(study.config)
    rows = load_predictions(found)
    new_rows = rescore_predictions(task, rows)
    was_unread = [r for r in rows if not r["verdicts"].get("json_valid")]
    now_unread = [r for r in new_rows if not r["verdicts"]["json_valid"]]
    recovered = [
        r for r, n in zip(rows, new_rows, strict=True)
        if not r["verdicts"].get("json_valid") and n["verdicts"]["json_valid"]
    ]  # fmt: skip
    moved = []
    for r, n in zip(rows, new_rows, strict=True):
        for f in task.fields:
            old = _old_field(r["verdicts"], f)
            new = _new_field(n["verdicts"], f)
            if old is not None and old != new:
                moved.append({"id": r["id"], "field": f, "old": old, "new": new,
                              "why": _why(r, n, f)})  # fmt: skip
    recorded = found["record"]["metrics"]
    metrics = compute_metrics(task, new_rows)
    keys = [k for k, v in metrics.items() if isinstance(v, float)]
    return {
        "run_id": run_id,
        "n": len(rows),
        "recorded_scoring": recorded.get("scoring"),
        "not_json_recorded": len(was_unread),
        "not_json_now": len(now_unread),
        "recovered": len(recovered),
        "recovered_stray_fence": sum(_closes_with_stray_fence(r["raw_output"]) for r in recovered),
        "unread_kinds_now": dict(Counter(n["verdicts"]["json_failure"] for n in now_unread)),
        "metrics": {k: [recorded.get(k), metrics[k]] for k in keys},
        "moved": moved,
    }


def main(argv: list[str] | None = None) -> int:
    from tunelab.core.study import Study

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("runs", nargs="*")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    study = Study.open(args.study)
    run_ids = args.runs or [r.id for r in study.list_runs() if r.status == "completed"]
    out = [x for x in (rescore_run(study, r) for r in run_ids) if x is not None]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for x in out:
        print(
            f"\n{x['run_id']}: {x['n']} answers (recorded by {x['recorded_scoring'] or 'an earlier scorer'})"
        )
        print(f"  judged not JSON: recorded {x['not_json_recorded']}, now {x['not_json_now']} "
              f"({x['recovered']} read now, {x['recovered_stray_fence']} of them closing with a "
              f"stray fence); still unread by kind: {x['unread_kinds_now']}")  # fmt: skip
        print(f"  {'metric':<24} {'recorded':>9} {'now':>9}")
        for k, (a, b) in x["metrics"].items():
            print(f"  {k:<24} {'-' if a is None else f'{a:.4f}':>9} {b:>9.4f}")
        print(f"  field verdicts moved (present, exact, match): {len(x['moved'])}")
        for m in x["moved"]:
            print(f"    {m['id']} {m['field']}: {m['old']} -> {m['new']}: {m['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
