"""Two `tunelab train` processes in one study at once: both finish, get distinct ids, and leave a
consistent ledger (rows, events and status files agree; SQLite's integrity check passes); a
`tunelab runs` in the middle never marks a live run interrupted. Three `tunelab data` at once
agree on one snapshot."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "stress"))
import harness  # noqa: E402
import pytest

from helpers import kill_harness_fixtures  # noqa: E402

STEPS = 8


def json_of(log: str) -> dict:
    """The `--json` result in a process's log (stdout and stderr together)."""
    return json.JSONDecoder().raw_decode(log[log.index("{\n") :])[0]


launcher, study_dir = kill_harness_fixtures("concurrency", steps=STEPS, checkpoint_every=3)


@pytest.mark.slow
def test_two_trains_at_once(study_dir, launcher):
    from tunelab.core.records import read_json
    from tunelab.core.study import Study

    procs = [
        launcher.start("train", "--name", name, "-s", study_dir, "--json") for name in ("a", "b")
    ]
    # while both run, another command opens the study: live runs stay running
    seen_running = set()
    while any(p.is_alive() for p in procs):
        study = Study.open(study_dir)
        assert study.reconcile() == []
        seen_running |= {r.id for r in study.ledger.list_runs() if r.status == "running"}
        time.sleep(0.2)
    for p in procs:
        p.join()
        assert p.exitcode == 0, harness.output(p)[-3000:]
    summaries = [json_of(harness.output(p)) for p in procs]
    ids = [s["run_id"] for s in summaries]
    assert len(set(ids)) == 2 and all(s["status"] == "completed" for s in summaries)
    assert seen_running <= set(ids)

    study = Study.open(study_dir)
    rows = {r.id: r for r in study.list_runs()}
    assert set(rows) == set(ids)
    first, second = rows[ids[0]], rows[ids[1]]
    assert first.created_at < second.finished_at and second.created_at < first.finished_at
    pids = {p.pid for p in procs}
    for run_id, name in zip(ids, ("a", "b"), strict=True):
        row = rows[run_id]
        assert row.status == "completed" and row.name == name and row.pid in pids
        assert row.finished_at and row.reason is None
        run_dir = study.runs_dir / run_id
        status = read_json(run_dir / "status.json")
        assert status["status"] == "completed" and status["run_id"] == run_id
        assert read_json(run_dir / "config.json")["run_id"] == run_id
        assert (run_dir / "DONE").exists()
        assert harness.assert_no_half_checkpoint(run_dir / "checkpoints") == []
        kinds = [e.kind for e in study.ledger.events(run_id)]
        assert kinds[0] == "created" and kinds.count("status:completed") == 1
        assert not [k for k in kinds if k in ("status:failed", "status:interrupted")]
    # every event belongs to a known run, and the database itself is sound
    assert {e.run_id for e in study.ledger.events() if e.run_id} <= set(ids)
    db = sqlite3.connect(study.records / "ledger.sqlite")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        db.close()
    # the same config and data in two processes at once give the same weights
    a, b = (harness.final_tensors(study.runs_dir / i) for i in ids)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert harness.curve(study.runs_dir / ids[0]) == harness.curve(study.runs_dir / ids[1])


@pytest.mark.slow  # three data builds in fresh processes (about 15 s)
def test_three_data_builds_at_once_agree(study_dir, launcher):
    from tunelab.core.study import Study
    from tunelab.stages.data import load_snapshot

    with open(study_dir / "mail.jsonl", "a") as f:  # new content: a new snapshot id
        f.write(
            json.dumps(
                {
                    "id": "new",
                    "text": "From: zed@example.com\nSubject: Hi",
                    "target": (json.dumps({"sender": "zed@example.com", "subject": "Hi"})),
                }
            )
            + "\n"
        )
    procs = [launcher.start("data", "-s", study_dir, "--json") for _ in range(3)]
    for p in procs:
        p.join(300)
    outputs = [harness.output(p) for p in procs]
    assert [p.exitcode for p in procs] == [0, 0, 0], outputs
    ids = {json_of(o)["snapshot_id"] for o in outputs}
    assert len(ids) == 1
    (sid,) = ids
    snap = load_snapshot(Study.open(study_dir), sid)  # complete, every file verified
    assert snap.counts["train"] > 0
    leftovers = [
        p.name for p in (study_dir / "records" / "data").iterdir() if p.name.startswith(".")
    ]
    assert leftovers == []
