"""Two nodes without a shared disk, on this machine: each torchrun agent (`tunelab train
--nnodes 2 --node-rank k`) trains from its own copy of the study folder, and the other copy is
hidden from it (`unshare --mount --pid` with a tmpfs mounted over the other node's folder), so
node 1 can read and write only its own copy; killing a node kills its whole PID namespace.

FSDP, LoRA (dropout 0.1), 1 rank a node: node 1 is held after step 2 (its checkpoint saved)
and its process group SIGKILLed, which leaves node 0's record `interrupted`; the same command
on both nodes resumes it. The result equals a single-node 2-rank run of the same study bit
for bit: every loss, gradient norm and validation loss, and the adapter's bytes. Node 1's copy
is left as it was: no run, no record, no file changed (marker `multinode`, CI's tier).

A full fine-tune on the same two nodes keeps its shards in training.shard_store and resumes
from it (markers `distributed` and `slow`: `make test-all`, over CI's budget for this file)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tree_hashes, write_email_study
from helpers.launch import tunelab_env
from helpers.nodes import free_port, kill_group, launch_nodes, node_options, said, wait_for
from tunelab.core.records import read_json, read_jsonl

STEPS, EVERY = 4, 2
SETS = ["--set", "training.packing=false"]
ADAPTER = Path("checkpoints/final/adapter/adapter_model.safetensors")


def _can_hide() -> str | None:
    """Why a node cannot be made here: mount and PID namespaces of its own (None: it can)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare(1) to hide one node's study copy from the other"
    probe = subprocess.run(
        [*hidden(Path("/mnt"), ["true"])],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"unshare -m cannot mount: {probe.stderr.strip()}"


@pytest.fixture(scope="module")
def copies(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """The study, registered with its snapshot, copied for node 0, node 1 and the reference."""
    why = _can_hide()
    if why:
        pytest.skip(why)
    top = tmp_path_factory.mktemp("nodes")
    origin = write_email_study(top / "origin", tiny_llama_dir, "nodes", max_steps=STEPS,
                               eval_every_steps=EVERY, checkpoint_every_steps=EVERY)  # fmt: skip
    out = {}
    for where in ("node0", "node1", "single"):
        out[where] = top / where / "study"
        shutil.copytree(origin, out[where])
    return out


def train(study: Path, *more: str, sets: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "tunelab", "train", "-s", str(study), "--nproc", "1",
            "--strategy", "fsdp", *SETS, *sets, "--name", "job", "--resume-if-exists", "--json",
            *more]  # fmt: skip


def resume(study: Path, *more: str) -> list[str]:
    """`tunelab resume job` with the run's layout given: node 1's copy has no record of it."""
    return [sys.executable, "-m", "tunelab", "resume", "job", "-s", str(study), "--nproc", "1",
            "--strategy", "fsdp", "--json", *more]  # fmt: skip


def hidden(other: Path, command: list[str]) -> list[str]:
    """`command` as a node of its own: in a mount namespace where `other` (the other node's
    folder) is an empty tmpfs, so nothing of it can be read or written, and in a PID namespace
    that dies whole with `unshare` (torchrun starts each rank in a session of its own: killing
    the launcher's process group alone would leave the ranks running)."""
    script = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
    namespaces = ["unshare", "--mount", "--pid", "--kill-child", "--propagation", "private"]
    return [*namespaces, "sh", "-c", script, str(other), *command]


def two_nodes(copies: dict[str, Path], node1_env: dict[str, str], during=None, sets=(), by=train):
    """`by` (train or resume) on both nodes, each hidden from the other's copy."""
    endpoint = f"127.0.0.1:{free_port()}"
    n0, n1 = copies["node0"], copies["node1"]
    more = {"sets": sets} if by is train else {}
    commands = [
        hidden(n1.parent, by(n0, *node_options(0, 2, endpoint), **more)),
        hidden(n0.parent, by(n1, *node_options(1, 2, endpoint), **more)),
    ]
    # a collective that waits 120 s for its peer fails (with its traceback) instead of hanging
    env = tunelab_env(TUNELAB_DIST_TIMEOUT_S="120")
    return launch_nodes(commands, 240, [env, {**env, **node1_env}], during)


def job_dir(study: Path) -> Path:
    runs = [p for p in (study / "records" / "runs").glob("*") if (p / "config.json").exists()]
    named = [p for p in runs if read_json(p / "config.json").get("name") == "job"]
    assert len(named) == 1, named
    return named[0]


def curve(run_dir: Path) -> list[tuple]:
    keys = ("step", "loss", "grad_norm", "val_loss", "tokens", "loss_tokens", "lr")
    return [tuple(r.get(k) for k in keys) for r in read_jsonl(run_dir / "metrics.jsonl")]


def killed_and_resumed(copies: dict[str, Path], sets: tuple[str, ...] = (), by=train) -> Path:
    """Node 1 held after step 2 and killed (its whole PID namespace), which leaves node 0's
    record interrupted; then the same command on both nodes (`by`: train --resume-if-exists,
    or resume) resumes the run. Its folder."""

    def kill_node1_after_checkpoint_2(nodes) -> None:
        wait_for(copies["node0"] / "records" / "runs", 120)
        run_dir = max((copies["node0"] / "records" / "runs").iterdir(), key=os.path.getmtime)
        wait_for(run_dir / "checkpoints" / "step-000002" / "DONE", 120)
        kill_group(nodes[1])

    codes, outs, hung = two_nodes(copies, {"TUNELAB_TEST_KILL_AT": "hold:2"},
                                  kill_node1_after_checkpoint_2, sets)  # fmt: skip
    assert not hung, said(outs)
    run_dir = job_dir(copies["node0"])
    status = read_json(run_dir / "status.json")
    assert codes[0] != 0 and status["status"] == "interrupted", (status, said(outs))
    assert status["reason"].startswith("another node's rank stopped")

    codes, outs, hung = two_nodes(copies, {}, sets=sets, by=by)
    assert not hung and codes == [0, 0], said(outs)
    resumed = json.loads(outs[0][0])
    assert (resumed.get("action", "resumed"), resumed["status"]) == ("resumed", "completed")
    assert resumed["run_id"] == run_dir.name and outs[1][0].strip() == ""
    return run_dir


@pytest.mark.multinode
def test_two_nodes_each_with_its_own_copy_killed_and_resumed_equal_one_node(copies):
    single = subprocess.run(
        [*train(copies["single"]), "--nproc", "2"], env=tunelab_env(), capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    reference = job_dir(copies["single"])
    node1_before = tree_hashes(copies["node1"])

    run_dir = killed_and_resumed(copies)

    assert curve(run_dir) == curve(reference)  # every loss, bit for bit
    assert (run_dir / ADAPTER).read_bytes() == (reference / ADAPTER).read_bytes()
    state = read_json(run_dir / "checkpoints" / "final" / "state.json")
    assert state["gathered"] is True and (state["strategy"], state["world_size"]) == ("fsdp", 2)
    # node 1 trained from its copy and left it as it was: no run, no record, no file changed
    assert not (copies["node1"] / "records" / "runs").exists() or not any(
        (copies["node1"] / "records" / "runs").iterdir()
    )
    assert tree_hashes(copies["node1"]) == node1_before


@pytest.fixture
def full_copies(tmp_path, tiny_llama_dir) -> dict[str, Path]:
    why = _can_hide()
    if why:
        pytest.skip(why)
    origin = write_email_study(tmp_path / "origin", tiny_llama_dir, "full", max_steps=STEPS,
                               eval_every_steps=EVERY, checkpoint_every_steps=EVERY)  # fmt: skip
    out = {"store": tmp_path / "store"}  # a folder both nodes mount
    for where in ("node0", "node1", "single"):
        out[where] = tmp_path / where / "study"
        shutil.copytree(origin, out[where])
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_full_fine_tune_on_two_nodes_keeps_its_shards_in_the_store_and_resumes_from_it(
    full_copies,
):
    """FSDP full fine-tuning on two nodes: each rank's shards go to training.shard_store, node
    0's checkpoint records where, and the run killed and resumed from the store (by `tunelab
    resume` on both nodes) gives one process's loss curve (1 process x micro 4 = 2 ranks x
    micro 2)."""
    from tunelab.core.study import Study
    from tunelab.stages.train import stage as train_stage

    store = full_copies["store"]
    sets = ("--set", "adaptation.method=full", "--set", f"training.shard_store={store}")
    run_dir = killed_and_resumed(full_copies, sets, by=resume)
    single = Study.open(full_copies["single"], ["adaptation.method=full",
                        "training.micro_batch_size=4", "training.packing=false"])  # fmt: skip
    reference = train_stage.run(single).dir
    for got, want in zip(read_jsonl(run_dir / "metrics.jsonl"),
                         read_jsonl(reference / "metrics.jsonl"), strict=True):  # fmt: skip
        assert got["step"] == want["step"]
        for name in ("loss", "val_loss"):
            assert abs(got.get(name, 0) - want.get(name, 0)) < 1e-5, (got, want)
    for step in (2, 4):
        state = read_json(run_dir / "checkpoints" / f"step-00000{step}" / "state.json")
        where = store / "full" / run_dir.name / f"step-00000{step}"
        assert state["shards"] == str(where) and (where / ".metadata").exists()
        assert len(list(where.glob("*.distcp"))) == 2  # one file per rank, in the store
        assert not (run_dir / "checkpoints" / f"step-00000{step}" / "dcp").exists()
    assert (run_dir / "checkpoints" / "final" / "model" / "model.safetensors").exists()
