"""Several nodes without a shared disk, without processes: a node whose study copy is not node
0's is refused by name; a full fine-tune under FSDP on several nodes needs training.shard_store
(validate and train refuse it before any work), and the store writes and reads shards in a
folder and at an fsspec URL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import run_cli, tree_hashes, write_email_study
from tunelab.core.errors import ConfigError, RunError
from tunelab.core.study import Study
from tunelab.stages.data import stage as data_stage
from tunelab.stages.train import shard_store
from tunelab.stages.train.nodes import copy_fingerprint, from_main, require_same_copies
from tunelab.stages.train.stage import prepare_run


class Gathered:
    """What the process group hands this rank (rank 1 of 2): `gather_objects` returns node
    0's object beside this rank's own, `broadcast_object` node 0's."""

    name, rank, world_size, is_main, shard_writer = "fsdp", 1, 2, False, None

    def __init__(self, node0: Any):
        self.node0 = node0

    def gather_objects(self, obj: Any) -> list[Any]:
        return [self.node0, obj]

    def broadcast_object(self, obj: Any) -> Any:
        return self.node0


@pytest.fixture
def two_copies(tmp_path, tiny_llama_dir) -> tuple[Path, Path]:
    node0 = write_email_study(tmp_path / "n0" / "study", tiny_llama_dir, "copies", max_steps=2,
                              eval_every_steps=0, checkpoint_every_steps=2)  # fmt: skip
    node1 = tmp_path / "n1" / "study"
    shutil.copytree(node0, node1)
    return node0, node1


def fingerprint(root: Path) -> dict[str, str]:
    return copy_fingerprint(prepare_run(Study.open(root)))


def test_copies_with_the_same_snapshot_pass_and_another_snapshot_is_refused_by_node(
    two_copies, monkeypatch
):
    node0, node1 = two_copies
    monkeypatch.setenv("GROUP_RANK", "1")
    node0_print = {"node": 0, "host": "node0-host", **fingerprint(node0)}
    require_same_copies(Gathered(node0_print), fingerprint(node1))  # an exact copy

    data = node1 / "mail.jsonl"  # node 1's copy gets a data snapshot of its own
    data.write_text(data.read_text() + data.read_text().splitlines()[0].replace("m0", "m99") + "\n")
    data_stage.run(Study.open(node1))
    with pytest.raises(RunError) as refused:
        require_same_copies(Gathered(node0_print), fingerprint(node1))
    message, hint = refused.value.message, refused.value.hint
    ours = fingerprint(node1)["snapshot"]
    assert "node 1 (" in message and "data snapshot" in message
    assert ours[:16] in message and node0_print["snapshot"][:16] in message
    assert "rsync" in hint and "node 0" in hint


def test_a_refusal_of_rank_0_is_raised_on_every_rank():
    refusal = ("ConfigError", "study.yaml: bad", "fix it")
    with pytest.raises(ConfigError, match="rank 0: study.yaml: bad") as raised:
        from_main(Gathered(("error", refusal)), lambda: pytest.fail("rank 1 must not work"))
    assert raised.value.hint == "fix it"
    assert from_main(Gathered(("ok", 42)), lambda: pytest.fail("rank 1 must not work")) == 42


# ------------------------------------------------------------------ the shard store


@pytest.mark.parametrize(
    "value, problem",
    [
        ("ckpt/shards", "a folder must be absolute"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("file://relative", "a file:// URL names an absolute folder"),
        ("s3://", "names no bucket or folder"),
    ],
)
def test_shard_store_values_are_refused_naming_the_file_and_field(
    tmp_path, tiny_llama_dir, capsys, value, problem
):
    root = write_email_study(tmp_path / "s", tiny_llama_dir, "store", max_steps=2,
                             eval_every_steps=0, checkpoint_every_steps=2)  # fmt: skip
    text = (root / "study.yaml").read_text().replace("training:\n", f"training:\n  shard_store: {json.dumps(value)}\n", 1)  # fmt: skip
    (root / "study.yaml").write_text(text)
    code, _, err = run_cli(capsys, "validate", "-s", root)
    assert code == 2 and "training.shard_store" in err and problem in err
    assert str(root / "study.yaml") in err  # located: the file and the field


def test_full_fine_tune_under_fsdp_on_several_nodes_needs_a_store(tmp_path, tiny_llama_dir, capsys):
    root = write_email_study(tmp_path / "s", tiny_llama_dir, "store", max_steps=2,
                             eval_every_steps=0, checkpoint_every_steps=2)  # fmt: skip
    full = ["--set", "adaptation.method=full"]
    before = tree_hashes(root)
    code, _, err = run_cli(capsys, "validate", "-s", root, *full, "--strategy", "fsdp",
                           "--nproc", "2", "--nnodes", "2")  # fmt: skip
    assert code == 2 and "on 2 nodes" in err and "training.shard_store" in err
    code, _, err = run_cli(capsys, "train", "-s", root, *full, "--strategy", "fsdp", "--nproc",
                           "1", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                           "127.0.0.1:1")  # fmt: skip
    assert code == 2 and "training.shard_store" in err
    assert tree_hashes(root) == before  # refused before any work
    # with a store, or on one node, or with LoRA, the layout is accepted
    store = f"training.shard_store={tmp_path / 'store'}"
    for more in ([*full, "--set", store, "--nnodes", "2"], [*full, "--nnodes", "1"],
                 ["--nnodes", "2"]):  # fmt: skip
        code, _, err = run_cli(capsys, "validate", "-s", root, "--strategy", "fsdp",
                               "--nproc", "2", *more)  # fmt: skip
        assert code == 0, (more, err)


def test_resume_on_another_node_needs_the_runs_layout(two_copies, capsys):
    """Node 1's copy has no record of the run: `tunelab resume` there needs --strategy and
    --nproc, and is refused without them before any work."""
    _, node1 = two_copies
    before = tree_hashes(node1)
    nodes = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1"]
    for given in ([], ["--strategy", "fsdp"], ["--nproc", "1"]):
        code, _, err = run_cli(capsys, "resume", "job", "-s", node1, *nodes, *given)
        assert code == 2 and "--strategy and --nproc" in err and "node other than 0" in err
    assert tree_hashes(node1) == before


@pytest.mark.parametrize("kind", ["folder", "file", "memory"])
def test_the_store_writes_and_reads_shards_in_a_folder_and_at_a_url(tmp_path, kind):
    import torch.distributed.checkpoint as dcp

    store = {"folder": str(tmp_path / "store"), "file": f"file://{tmp_path}/store",
             "memory": f"memory://tunelab-test-{tmp_path.name}"}[kind]  # fmt: skip
    where = shard_store.location(store, "study", "train-1", 4)
    assert where.endswith("/study/train-1/step-000004")
    assert not shard_store.has_shards(where)
    saved = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(4.0)}
    dcp.save(saved, storage_writer=shard_store.writer(where))  # one process: no group needed
    assert shard_store.has_shards(where)
    if kind != "memory":
        assert (tmp_path / "store" / "study" / "train-1" / "step-000004" / ".metadata").exists()
    back = {"w": torch.zeros(2, 3), "step": torch.tensor(0.0)}
    dcp.load(back, storage_reader=shard_store.reader(where))
    assert all(torch.equal(back[k], saved[k]) for k in saved)
    shard_store.remove(where)
    assert not shard_store.has_shards(where)
