"""A damaged ledger is found on opening, kept beside as ledger.sqlite.damaged-*, and rebuilt
from records/runs: `tunelab runs` then lists exactly the runs the records hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import run_cli, tree_hashes
from tunelab.core.ledger import LedgerRebuilt
from tunelab.core.study import Study


@pytest.fixture(scope="module")
def study_root(tmp_path_factory) -> Path:
    """A study with runs of every finished status, and a test-split evaluation."""
    root = tmp_path_factory.mktemp("ledger") / "s"
    from tunelab.cli import main

    try:
        main(["init", str(root)])
    except SystemExit as exc:
        assert exc.code in (0, None)
    s = Study.open(root)
    for status in ("completed", "failed", "interrupted", "invalid", "completed"):
        run = s.create_run("train", name=f"r-{status}-{len(s.ledger.list_runs())}", why="w")
        run.set_status(status, None if status == "completed" else f"because {status}")
    parent = s.ledger.list_runs()[0].id
    ev = s.create_run("eval", parent=parent, data_snapshot="abc", extra={"split": "test"})
    ev.set_status("completed")
    for i in range(300):  # a ledger of several pages
        s.ledger.add_event(parent, "note", {"i": i, "text": "x" * 40})
    return root


def listed(root: Path, capsys) -> list[dict]:
    code, out, err = run_cli(capsys, "runs", "-s", root, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("where", ["empty", "header", "middle"])
def test_truncated_ledger_is_detected_and_rebuilt(study_root, tmp_path, capsys, where):
    root = tmp_path / "s"
    shutil.copytree(study_root, root)
    want = {r["id"]: (r["kind"], r["name"], r["status"], r["reason"], r["parent"]) for r in
            listed(root, capsys)}  # fmt: skip
    ledger = root / "records" / "ledger.sqlite"
    assert not ledger.with_name("ledger.sqlite-wal").exists()
    data = ledger.read_bytes()
    cut = {"empty": 0, "header": 60, "middle": (len(data) // 2 // 4096) * 4096 + 100}[where]
    assert cut < len(data)
    ledger.write_bytes(data[:cut])
    before = tree_hashes(root / "records")
    with pytest.warns(LedgerRebuilt, match="damaged.*rebuilt from.*kept as ledger.sqlite.damaged-"):
        rows = listed(root, capsys)
    got = {r["id"]: (r["kind"], r["name"], r["status"], r["reason"], r["parent"]) for r in rows}
    assert got == want
    (aside,) = root.glob("records/ledger.sqlite.damaged-*[0-9]")
    assert aside.read_bytes() == data[:cut]
    assert tree_hashes(root / "records") == before  # no record changed
    s = Study.open(root)
    assert len(s.ledger.test_openings()) == 1
    assert s.ledger.rebuilt is None  # rebuilt once; sound from then on


def _open_at_once(root: str, barrier) -> None:
    barrier.wait()
    s = Study.open(root)
    s.create_run("train").set_status("completed")


@pytest.mark.processes
def test_processes_opening_a_new_ledger_at_once_do_not_take_it_for_damaged(tmp_path, capsys):
    """A ledger another process is still creating has no tables yet: the other openers wait for
    it instead of moving it aside as damaged (which lost runs and crashed the openers)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for trial in range(2):
        root = tmp_path / f"s{trial}"
        run_cli(capsys, "init", root)
        barrier = ctx.Barrier(3)
        procs = [ctx.Process(target=_open_at_once, args=(str(root), barrier)) for _ in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        assert not list((root / "records").glob("ledger.sqlite.damaged*"))
        assert len(Study.open(root).list_runs()) == 3
