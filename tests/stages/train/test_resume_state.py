"""`tunelab resume` checks the optimizer, scheduler and generator states of its checkpoint
against the layout recorded at save before the run is touched: a damaged state whose hashes were
rewritten to match is refused with the file and tensor named, exit 2, the run's records (its
status included) byte-identical. A checkpoint cut before its DONE marker is skipped, and said."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import run_cli, train_stopped_at, tree_hashes, write_email_study
from tunelab.core.errors import CheckpointError
from tunelab.core.hashing import sha256_file
from tunelab.core.records import read_json
from tunelab.core.study import Study
from tunelab.stages.train import resume_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_llama_dir) -> tuple[Path, str]:
    """A study whose run was stopped by SIGTERM at step 3 (checkpoints at 2 and 3)."""
    root = write_email_study(
        tmp_path_factory.mktemp("resume-state") / "s",
        tiny_llama_dir,
        "resume-state",
        max_steps=5,
        eval_every_steps=0,
        checkpoint_every_steps=2,
    )
    row = train_stopped_at(Study.open(root), 3, "stopped")
    return root, row.id


def copy_of(stopped: tuple[Path, str], tmp_path: Path) -> tuple[Path, Path]:
    root, run_id = stopped
    copy = tmp_path / "s"
    shutil.copytree(root, copy, symlinks=True)
    return copy, copy / "records" / "runs" / run_id / "checkpoints" / "step-000003"


def rehash(ckpt: Path, name: str) -> None:
    """What a buggy writer does: the file's new sha256 recorded in state.json."""
    state = read_json(ckpt / "state.json")
    if (ckpt / name).exists():
        state["files"][name] = sha256_file(ckpt / name)
    else:
        state["files"].pop(name)
    (ckpt / "state.json").write_text(json.dumps(state))


def rewrite_tensors(ckpt: Path, name: str, edit) -> None:  # noqa: ANN001
    tensors = load_file(str(ckpt / name))
    edit(tensors)
    save_file(tensors, str(ckpt / name))
    rehash(ckpt, name)


def wrong_moment_shape(t: dict[str, torch.Tensor]) -> None:
    t["0.exp_avg"] = torch.zeros(3, 3)


def moment_as_half(t: dict[str, torch.Tensor]) -> None:
    t["1.exp_avg_sq"] = t["1.exp_avg_sq"].half()


def lose_a_moment(t: dict[str, torch.Tensor]) -> None:
    del t["2.exp_avg"]


def lose_numpy_keys(t: dict[str, torch.Tensor]) -> None:
    del t["numpy.keys"]


def torch_rng_as_floats(t: dict[str, torch.Tensor]) -> None:
    t["torch"] = t["torch"].float()


DAMAGE = {
    "optimizer shape": ("optimizer.safetensors", wrong_moment_shape, "'0.exp_avg' is F32 [3, 3]"),
    "optimizer dtype": ("optimizer.safetensors", moment_as_half, "'1.exp_avg_sq' is F16"),
    "optimizer missing": ("optimizer.safetensors", lose_a_moment, "missing ['exp_avg']"),
    "rng missing": ("rng.safetensors", lose_numpy_keys, "'numpy.keys' missing"),
    "rng dtype": ("rng.safetensors", torch_rng_as_floats, "'torch' is F32"),
}


def assert_refused_untouched(copy: Path, run_id: str, capsys, match: str) -> None:
    before = tree_hashes(copy / "records")
    status = (copy / "records" / "runs" / run_id / "status.json").read_bytes()
    code, _, err = run_cli(capsys, "resume", run_id, "-s", copy)
    assert code == 2, err
    assert match in " ".join(err.split()), err
    assert tree_hashes(copy / "records") == before
    assert (copy / "records" / "runs" / run_id / "status.json").read_bytes() == status
    assert Study.open(copy).ledger.get_run(run_id).status == "interrupted"


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_state_with_matching_hashes_is_refused(stopped, tmp_path, capsys, case):
    copy, ckpt = copy_of(stopped, tmp_path)
    name, edit, match = DAMAGE[case]
    rewrite_tensors(ckpt, name, edit)
    assert_refused_untouched(copy, stopped[1], capsys, match)


def test_missing_state_files_and_damaged_json_are_refused(stopped, tmp_path, capsys):
    copy, ckpt = copy_of(stopped, tmp_path)
    (ckpt / "optimizer.json").unlink()
    rehash(ckpt, "optimizer.json")
    assert_refused_untouched(copy, stopped[1], capsys, "optimizer.json: missing")
    copy2, ckpt2 = copy_of(stopped, tmp_path / "2")
    state = read_json(ckpt2 / "state.json")
    state["rng"]["python"]["state"] = state["rng"]["python"]["state"][:10]
    (ckpt2 / "state.json").write_text(json.dumps(state))
    assert_refused_untouched(copy2, stopped[1], capsys, "rng.python.state")
    copy3, ckpt3 = copy_of(stopped, tmp_path / "3")
    meta = read_json(ckpt3 / "optimizer.json")
    meta["param_groups"][0]["params"] = meta["param_groups"][0]["params"][:-1]
    (ckpt3 / "optimizer.json").write_text(json.dumps(meta))
    rehash(ckpt3, "optimizer.json")
    assert_refused_untouched(copy3, stopped[1], capsys, "optimizer.json: param_groups list")


def test_sound_checkpoint_resumes_and_names_an_incomplete_one(stopped, tmp_path):
    copy, ckpt = copy_of(stopped, tmp_path)
    cut = ckpt.parent / "step-000004"  # a save cut by a kill: no DONE
    shutil.copytree(ckpt, cut)
    (cut / "DONE").unlink()
    study = Study.open(copy)
    run = resume_run(study, stopped[1])
    assert run.status()["status"] == "completed"
    events = study.ledger.events(run.id)
    resumed = [e for e in events if e.kind == "status:running"][-1]
    assert "resumed from step-000003; step-000004 skipped: no DONE marker" in resumed.detail
    assert any(e.kind == "checkpoint_skipped" for e in events)


def test_load_checkpoint_checks_the_state_too(stopped, tmp_path):
    """A caller that loads an optimizer through load_checkpoint meets the same check."""
    copy, ckpt = copy_of(stopped, tmp_path)
    rewrite_tensors(ckpt, "optimizer.safetensors", wrong_moment_shape)
    from tunelab.stages.train.resume_check import require_resume_state

    with pytest.raises(CheckpointError, match=r"parameter 0 \(.*lora_A"):
        require_resume_state(ckpt, read_json(ckpt / "state.json"))
