"""The status node 0's launcher leaves when torchrun fails: a node whose ranks only lost their
peers (another node's rank was killed or preempted) leaves the run `interrupted`; on one node,
or with a failure of its own, the run is `failed` naming the rank. No processes: the launch
folder holds the rank records a failed torchrun leaves."""

from __future__ import annotations

import json

import pytest

from helpers import write_email_study
from tunelab.core.records import read_json
from tunelab.core.study import Study
from tunelab.stages.train.launch import settle

PEER_GONE = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4"


def launch_folder(tmp_path, run, errors: dict[int, str]):
    folder = tmp_path / "launch"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"run_id": run.id, "run_dir": str(run.dir)}))
    for rank, error in errors.items():
        record = {"rank": rank, "kind": "failed", "error": error, "host": "h", "traceback": ""}
        (folder / f"rank-{rank}.json").write_text(json.dumps(record))
    return folder


@pytest.mark.parametrize(
    "several_nodes, errors, want",
    [
        (True, {0: PEER_GONE}, "interrupted"),
        (False, {0: PEER_GONE}, "failed"),  # one node: the lost peer was one of its own ranks
        (True, {0: PEER_GONE, 1: "ValueError: bad"}, "failed"),
    ],
)
def test_a_node_that_only_lost_its_peers_leaves_the_run_interrupted(
    tmp_path, tiny_llama_dir, several_nodes, errors, want
):
    root = write_email_study(tmp_path / "s", tiny_llama_dir, "status", max_steps=4,
                             eval_every_steps=0, checkpoint_every_steps=2)  # fmt: skip
    study = Study.open(root)
    run = study.create_run("train", name="job")
    run.set_status("failed", PEER_GONE)  # what the rank itself recorded
    result = settle(root, launch_folder(tmp_path, run, errors), 1, several_nodes=several_nodes)
    status = read_json(run.dir / "status.json")
    assert result.status == status["status"] == want
    assert study.ledger.get_run(run.id).status == want
    if want == "interrupted":
        assert status["reason"].startswith("another node's rank stopped")
    else:
        assert status["reason"].startswith("rank 1: ValueError" if 1 in errors else "rank 0")
