"""`tunelab train` / `tunelab resume` on a tiny Llama extraction study: records, every status
reached for real, kills (SIGKILL, SIGTERM, a kill in the middle of a checkpoint save) and resumes
that end bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import run_cli, write_email_study
from helpers.train_run import assert_same_result, final_adapter
from tunelab.core.errors import PreprocessError, RunError
from tunelab.core.records import read_json, read_jsonl
from tunelab.core.study import Study
from tunelab.stages.train import InvalidRun, RunFailed, load_run_model, resume_run
from tunelab.stages.train import checkpoint as ckpt
from tunelab.stages.train import stage as train_stage

REPO = Path(__file__).resolve().parents[3]
STEPS = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def write_study(root: Path, model_dir: Path, **training) -> Path:
    """A registered extraction study (sender, subject) on the tiny Llama with a snapshot."""
    return write_email_study(
        root,
        model_dir,
        "train-test",
        max_steps=STEPS,
        eval_every_steps=4,
        checkpoint_every_steps=3,
        **training,
    )


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return write_study(tmp_path_factory.mktemp("train") / "s", tiny_llama_dir)


@pytest.fixture(scope="module")
def straight(study_dir):
    """The uninterrupted run every interrupted one must equal."""
    torch.set_num_threads(1)
    run = train_stage.run(Study.open(study_dir), name="straight", why="reference")
    return run


KILLS = {
    "kill-step5": "step:5",
    "kill-in-save6": "save:6",
    "term-step5": "term:5",
    "kill-step2": "step:2",  # before the first checkpoint (step 3)
}


@pytest.fixture(scope="module")
def killed(study_dir, straight) -> dict[str, tuple[int, str, Path]]:
    """The three interrupted runs, started together (separate processes, killed for real):
    name -> (return code, stderr, run folder)."""
    procs = {
        name: start_cli(study_dir, "train", "--name", name, kill_at=point)
        for name, point in KILLS.items()
    }
    out = {}
    study = Study.open(study_dir)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        (row,) = [r for r in study.ledger.list_runs() if r.name == name]
        out[name] = (proc.returncode, err, study.runs_dir / row.id)
    return out


def start_cli(study_dir: Path, *args: str, kill_at: str | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(REPO / "src"),
    }
    env.pop("TUNELAB_TEST_KILL_AT", None)
    if kill_at:
        env["TUNELAB_TEST_KILL_AT"] = kill_at
    return subprocess.Popen(
        [sys.executable, "-m", "tunelab", *args, "-s", str(study_dir), "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def only_new_run(study: Study, before: set[str]) -> str:
    new = [r.id for r in study.ledger.list_runs() if r.id not in before]
    assert len(new) == 1, new
    return new[0]


def run_ids(study_dir: Path) -> set[str]:
    return {r.id for r in Study.open(study_dir).ledger.list_runs()}


# ---------------------------------------------------------------- a completed run


def test_completed_run_records(study_dir, straight):
    run = straight
    status = read_json(run.dir / "status.json")
    assert status["status"] == "completed" and status["steps"] == STEPS
    assert status["val_loss"] < status["val_loss_initial"]
    assert (run.dir / "DONE").exists()
    config = read_json(run.dir / "config.json")
    study = Study.open(study_dir)
    assert config["config_sha256"] == study.config.sha256()
    assert config["hypothesis_version"] == 1 and config["data_snapshot"]
    assert config["name"] == "straight" and config["why"] == "reference"
    assert read_json(run.dir / "env.json")["torch"] == torch.__version__
    assert read_json(run.dir / "audit.json")["method"] == "lora"
    pre = read_json(run.dir / "preprocess.json")
    n_train = pre["train"]["n"]
    assert len(pre["template_sha256"]) == 64 and 25 < n_train < 36
    rows = read_jsonl(run.dir / "metrics.jsonl")
    assert rows[0] == {
        "step": 0,
        "val_loss": rows[0]["val_loss"],
        "val_tokens": rows[0]["val_tokens"],
    }
    steps = rows[1:]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        for key in ("loss", "lr", "grad_norm", "tokens", "loss_tokens", "seconds", "memory_bytes"):
            assert r[key] is not None and r[key] >= 0, key
    assert [r["step"] for r in steps if "val_loss" in r] == [4, 8]
    assert steps[0]["lr"] < steps[1]["lr"] < steps[2]["lr"]  # warm-up
    # checkpoints: every 3 steps and at the end, the last 2 kept, final -> step-000008
    root = run.dir / "checkpoints"
    assert [p.name for _, p in ckpt.list_checkpoints(root)] == ["step-000006", "step-000008"]
    assert os.readlink(root / "final") == "step-000008"
    final = root / "step-000008"
    names = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()}
    assert {
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "optimizer.safetensors",
        "optimizer.json",
        "scheduler.json",
        "rng.safetensors",
        "state.json",
        "DONE",
    } <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl", ".pth"))]
    state = read_json(final / "state.json")
    assert state["step"] == STEPS and state["config_sha256"] == config["config_sha256"]
    assert state["data_snapshot"] == config["data_snapshot"]
    epoch, index = divmod(STEPS * 4, n_train)  # 8 steps of 4 examples, across epochs
    assert state["position"] == {"epoch": epoch, "index": index}
    assert state["rng"]["python"]["state"]
    # the ledger agrees
    row = study.ledger.get_run(run.id)
    assert row.status == "completed" and row.data_snapshot == config["data_snapshot"]


def test_load_run_model_gives_the_trained_weights(study_dir, straight):
    from peft import PeftModel

    model, tokenizer, base = load_run_model(Study.open(study_dir), straight.id)
    assert isinstance(model, PeftModel) and not model.training
    assert base.architecture == "causal_lm" and tokenizer.eos_token == "<|im_end|>"
    saved = final_adapter(straight.dir)
    params = {n.replace(".default", ""): p for n, p in model.named_parameters()}
    assert all(torch.equal(params[n], t) for n, t in saved.items())
    earlier, _, _ = load_run_model(Study.open(study_dir), straight.id, checkpoint=6)
    assert any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), earlier.parameters(), strict=True)
    )
    with pytest.raises(Exception, match="no complete checkpoint 'step-000003'"):
        load_run_model(Study.open(study_dir), straight.id, checkpoint=3)  # pruned


def test_cli_train_with_parent_and_why(study_dir, straight, capsys):
    code, out, err = run_cli(
        capsys,
        "train",
        "-s",
        study_dir,
        "--name",
        "lr-up",
        "--parent",
        straight.id,
        "--why",
        "a higher learning rate",
        "--set",
        "training.lr=3e-2",
        "--set",
        "training.max_steps=2",
        "--json",
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["status"] == "completed" and summary["steps"] == 2
    config = read_json(Path(summary["record"]) / "config.json")
    assert config["parent"] == straight.id and config["why"] == "a higher learning rate"
    assert config["overrides"] == ["training.lr=3e-2", "training.max_steps=2"]
    code, _, err = run_cli(capsys, "train", "-s", study_dir, "--parent", "nope", "--json")
    assert code == 2 and "parent run 'nope' not found" in err


def test_heartbeat_beats_between_steps(study_dir, monkeypatch):
    """A slow step must not look like a dead process: the heartbeat runs in its own thread."""
    import time

    from tunelab.stages.train import callbacks

    monkeypatch.setattr(callbacks, "HEARTBEAT_EVERY_S", 0.05)
    study = Study.open(study_dir)
    run = study.create_run("train")
    with callbacks.Heartbeat(run) as beat:
        beat.step, beat.total_steps = 3, 8
        first = study.ledger.get_run(run.id).heartbeat_at
        time.sleep(0.5)  # no step ends meanwhile
        later = study.ledger.get_run(run.id).heartbeat_at
    assert later > first
    status = read_json(run.dir / "status.json")
    assert status["status"] == "running" and status["step"] == 3 and status["pid"] == os.getpid()
    run.set_status("interrupted", "test run")
    time.sleep(0.2)
    assert read_json(run.dir / "status.json")["status"] == "interrupted"  # stopped for good


# ---------------------------------------------------------------- kills and resumes


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(study_dir, straight, killed, capsys):
    code, _, run_dir = killed["kill-step5"]
    assert code == -signal.SIGKILL
    run_id = run_dir.name
    study = Study.open(study_dir)
    status = read_json(run_dir / "status.json")
    assert status["status"] == "running" and status["heartbeat_at"]  # left behind by the kill
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")][-1] == 5
    assert run_id in study.reconcile()  # the pid is gone: interrupted
    assert study.ledger.get_run(run_id).status == "interrupted"
    assert "stale heartbeat" in read_json(run_dir / "status.json")["reason"]
    code, out, err = run_cli(capsys, "resume", run_id, "-s", study_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["status"] == "completed"
    assert_same_result(run_dir, straight.dir)
    replayed = read_jsonl(run_dir / "metrics-replayed.jsonl")
    assert [r["step"] for r in replayed] == [4, 5]  # after checkpoint 3, done again on resume
    events = [e.kind for e in study.ledger.events(run_id)]
    assert events.count("status:running") == 1 and "status:interrupted" in events


@pytest.mark.slow  # the killed runs' fixture starts and kills fresh processes (about 30 s)
def test_kill_during_checkpoint_save_keeps_previous_usable(study_dir, straight, killed):
    code, _, run_dir = killed["kill-in-save6"]
    assert code == -signal.SIGKILL
    root = run_dir / "checkpoints"
    partial = [p for p in root.iterdir() if p.name.startswith(".step-000006.tmp-")]
    assert len(partial) == 1 and not (partial[0] / "DONE").exists()
    assert (partial[0] / "optimizer.safetensors").exists()  # cut in the middle of the save
    assert not (root / "step-000006").exists()
    assert ckpt.latest_checkpoint(root) == root / "step-000003"
    ckpt.read_checkpoint_state(root / "step-000003")  # complete, hashes match
    run = resume_run(Study.open(study_dir), run_dir.name)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert_same_result(run.dir, straight.dir)


@pytest.mark.slow  # the killed runs' fixture starts and kills fresh processes (about 30 s)
def test_sigterm_saves_a_checkpoint_then_resume_is_bit_exact(study_dir, straight, killed):
    code, err, run_dir = killed["term-step5"]
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step 5" in err and "tunelab resume" in err
    status = read_json(run_dir / "status.json")
    assert status["status"] == "interrupted" and "SIGTERM" in status["reason"]
    assert ckpt.latest_checkpoint(run_dir / "checkpoints").name == "step-000005"
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")][-1] == 5
    run = resume_run(Study.open(study_dir), run_dir.name)
    assert not (run_dir / "metrics-replayed.jsonl").exists()  # nothing after step 5 to redo
    assert_same_result(run.dir, straight.dir)


@pytest.mark.slow  # the killed runs' fixture starts and kills fresh processes (about 30 s)
def test_kill_before_the_first_checkpoint_resumes_from_the_start(study_dir, straight, killed):
    code, _, run_dir = killed["kill-step2"]
    assert code == -signal.SIGKILL
    assert not ckpt.list_checkpoints(run_dir / "checkpoints")
    run = resume_run(Study.open(study_dir), run_dir.name)
    assert_same_result(run.dir, straight.dir)  # one step-0 line, steps 1..8 once
    replayed = read_jsonl(run_dir / "metrics-replayed.jsonl")
    assert [r["step"] for r in replayed] == [0, 1, 2]


# ---------------------------------------------------------------- invalid and failed


def test_nan_loss_is_invalid(study_dir, capsys):
    before = run_ids(study_dir)
    code, _, err = run_cli(capsys, "train", "-s", study_dir, "--set", "training.lr=1e30")
    assert code == 2 and "non-finite" in err
    study = Study.open(study_dir)
    run_id = only_new_run(study, before)
    row = study.ledger.get_run(run_id)
    assert row.status == "invalid" and "non-finite" in row.reason
    assert not (study.runs_dir / run_id / "checkpoints" / "final").exists()
    code, out, _ = run_cli(capsys, "runs", "-s", study_dir, "--json")
    listed = {r["id"]: r for r in json.loads(out)}
    assert listed[run_id]["status"] == "invalid" and "non-finite" in listed[run_id]["reason"]


def test_update_check_violation_is_invalid(study_dir):
    study = Study.open(study_dir, ["training.lr=1e-30"])  # too small to move any weight
    with pytest.raises(InvalidRun, match="update check after step 2") as exc:
        train_stage.run(study)
    assert "lora_A" in exc.value.message and "unchanged" in exc.value.message
    row = study.ledger.list_runs()[-1]
    assert row.status == "invalid" and "lora_A" in row.reason


def test_exception_is_failed_with_message(study_dir, capsys):
    before = run_ids(study_dir)
    code, _, err = run_cli(
        capsys, "train", "-s", study_dir, "--set", "training.optimizer=SparseAdam"
    )
    assert code == 1 and "SparseAdam does not support dense gradients" in err
    study = Study.open(study_dir)
    run_id = only_new_run(study, before)
    status = read_json(study.runs_dir / run_id / "status.json")
    assert status["status"] == "failed" and status["error"] == "RuntimeError"
    assert "SparseAdam" in status["reason"] and "Traceback" in status["traceback"]
    with pytest.raises(RunFailed):  # the library raises it too
        train_stage.run(Study.open(study_dir, ["training.optimizer=SparseAdam"]))


def test_broken_loss_mask_is_invalid(tmp_path, tiny_llama_dir, capsys):
    from tunelab.stages.hypothesis import stage as hyp

    root = write_study(tmp_path / "short", tiny_llama_dir)
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["preprocess"]["max_seq_len"] = 40  # the target no longer fits
    raw["evaluation"]["max_new_tokens"] = 16  # below the window, as register asks
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    hyp.run(root, Study.open(root).config)
    code, _, err = run_cli(capsys, "train", "-s", root)
    assert code == 2 and "error:" in err
    row = Study.open(root).ledger.list_runs()[-1]
    assert row.status == "invalid" and row.reason
    with pytest.raises(PreprocessError):
        train_stage.run(Study.open(root))


# ---------------------------------------------------------------- resume refusals


def test_resume_refuses_completed_running_changed_config_and_data(study_dir, straight, tmp_path):
    study = Study.open(study_dir)
    with pytest.raises(RunError, match="already completed"):
        resume_run(study, straight.id)
    record = read_json(straight.dir / "config.json")
    alive = study.create_run(  # a run record of this (alive) process
        "train",
        data_snapshot=record["data_snapshot"],
        extra={"base_model": record["base_model"], "labels": None},
    )
    with pytest.raises(RunError, match="still running"):
        resume_run(study, alive.id)
    alive.set_status("interrupted", "test")
    # an interrupted run of a copied study, then study.yaml edited: refused with the diff
    copy = tmp_path / "copy"
    shutil.copytree(study_dir, copy)
    raw = yaml.safe_load((copy / "study.yaml").read_text())
    raw["training"]["lr"] = 0.5
    (copy / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    copied = Study.open(copy)
    with pytest.raises(RunError, match=r"training.lr: 0.02 -> 0.5") as exc:
        resume_run(copied, alive.id)
    assert "start a new run" in exc.value.hint
    # config restored, but the data changed and a new snapshot was built: refused
    raw["training"]["lr"] = 2e-2
    (copy / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with open(copy / "mail.jsonl", "a") as f:
        target = json.dumps({"sender": "zed@example.com", "subject": "Hello"})
        f.write(json.dumps({"id": "new", "text": "From: zed@example.com", "target": target}) + "\n")
    from tunelab.stages.data import stage as data_stage

    data_stage.run(Study.open(copy))
    with pytest.raises(RunError, match="data snapshot changed"):
        resume_run(Study.open(copy), alive.id)
