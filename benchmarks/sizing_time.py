"""How long `tunelab size` takes with one measuring process for all configurations, against a
fresh process for each (`--fresh-processes`), and whether the memory figures agree.

    python benchmarks/sizing_time.py STUDY --seq-len 96

Both sizings run on a copy of STUDY (its config, data and data snapshot; no record is written
into STUDY), one after the other in the same run, fresh first. Prints each sizing's seconds,
per configuration the measured increase and peak of both and their difference in percent, the
step and forward times of both, each sizing's phase seconds and timed steps, and last
`ratio_time_fresh_vs_shared=X max_memory_diff_pct=Y` (Y: the largest difference of `increase`
or `peak_total` over the configurations both measured).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tunelab.core.study import Study
from tunelab.stages.sizing import stage as sizing_stage


def _copy(study: Path, into: Path) -> Path:
    """The study without its runs and sizings (the data snapshot and the ledger kept)."""
    out = into / study.name
    shutil.copytree(
        study, out, ignore=lambda d, _names: {"runs", "sizing"} if d.endswith("records") else set()
    )
    return out


def _size(study: Path, seq_lens: list[int], fresh: bool) -> dict[str, Any]:
    record, _ = sizing_stage.run(Study.open(study), seq_lens=seq_lens, shared=not fresh)
    return record


def _diff(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else 100.0 * (a - b) / b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("--seq-len", default=None, help="e.g. 96 (default: the data's)")
    args = parser.parse_args()
    seq_lens = [int(x) for x in args.seq_len.split(",")] if args.seq_len else None
    with tempfile.TemporaryDirectory(prefix="sizing-time-") as tmp:
        study = _copy(args.study.resolve(), Path(tmp))
        fresh = _size(study, seq_lens, fresh=True)
        shared = _size(study, seq_lens, fresh=False)
    print(f"fresh processes: {fresh['seconds']:.1f} s   one process: {shared['seconds']:.1f} s")
    worst = 0.0
    rows = {r["label"]: r for r in fresh["configurations"]}
    for s in shared["configurations"]:
        f = rows.get(s["label"])
        if not f or s["status"] != "ok" or f["status"] != "ok":
            print(f"{s['label']}: shared {s['status']}, fresh {f and f['status']}")
            continue
        line = [s["label"]]
        for key in ("increase", "peak_total"):
            a, b = s["measured"].get(key), f["measured"].get(key)
            d = _diff(a, b)
            worst = max(worst, abs(d or 0.0))
            line.append(f"{key} {a / 2**20:.1f} vs {b / 2**20:.1f} MiB ({d:+.2f} %)")
        for key in ("step_s", "forward_s"):
            line.append(f"{key} {s['measured'][key]:.2f} vs {f['measured'][key]:.2f}")
        print("  ".join(line))
    for name, record in (("fresh", fresh), ("shared", shared)):
        for r in record["configurations"]:
            phases = (r.get("measured") or {}).get("phase_s") or {}
            print(f"{name} {r['label']} phase_s " + " ".join(f"{k}={v}" for k, v in phases.items()))
            steps = (r.get("measured") or {}).get("step_s_all") or []
            print(f"{name} {r['label']} step_s_all " + " ".join(f"{x:.2f}" for x in steps))
    ratio = fresh["seconds"] / shared["seconds"]
    print(f"ratio_time_fresh_vs_shared={ratio:.2f} max_memory_diff_pct={worst:.2f}")


if __name__ == "__main__":
    main()
