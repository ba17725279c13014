"""The platform gate: `train` and `resume` refuse on a platform where no smoke of the study
passed, naming `tunelab smoke`; a smoke here lets them go on, and so does `--other-platform`
with its `--why` recorded. Another platform is simulated by editing the torch version that
the passing smoke's env.json recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_cli, train_stopped_at, tree_hashes, write_email_study
from tunelab.core.records import read_json, read_jsonl
from tunelab.core.study import Study
from tunelab.stages.smoke.platform import platforms_of

pytestmark = pytest.mark.usefixtures("one_thread")


def smoke(root: Path, capsys) -> str:
    code, out, err = run_cli(capsys, "smoke", "-s", root, "--json", "--train-examples", "4",
                             "--steps", "1", "--eval-examples", "2")  # fmt: skip
    assert code == 0, err
    return json.loads(out)["run_id"]


def move_smokes_elsewhere(study: Study) -> None:
    for row in study.ledger.list_runs("smoke"):
        env_path = study.runs_dir / row.id / "env.json"
        env = read_json(env_path)
        env["torch"] = "0.0.0+elsewhere"
        env_path.write_text(json.dumps(env))


def test_resume_on_another_platform(tmp_path, tiny_llama_dir, capsys):
    root = write_email_study(tmp_path / "s", tiny_llama_dir, "platform", max_steps=4,
                             eval_every_steps=0, checkpoint_every_steps=2)  # fmt: skip
    study = Study.open(root)
    smoke(root, capsys)
    a = train_stopped_at(study, 3, "a")
    b = train_stopped_at(study, 3, "b")
    move_smokes_elsewhere(study)
    before = tree_hashes(root / "records")
    for args in (["resume", a.id], ["train", "--name", "c"], ["resume", a.id, "--other-platform"]):
        code, _, err = run_cli(capsys, *args, "-s", root)
        text = " ".join(err.split())
        assert code == 2, err
        assert "--why" in text if "--other-platform" in args else "`tunelab smoke -s" in text
        assert "torch 0.0.0+elsewhere -> " in text or "--other-platform" in args
    assert tree_hashes(root / "records") == before
    assert Study.open(root).ledger.get_run(a.id).status == "interrupted"
    # the override goes on, its reason recorded with the run
    code, _, err = run_cli(capsys, "resume", a.id, "-s", root, "--other-platform",
                           "--why", "the smoke is queued")  # fmt: skip
    assert code == 0, err
    (override,) = read_jsonl(study.runs_dir / a.id / "platform-overrides.jsonl")
    assert override["why"] == "the smoke is queued"
    assert override["smoke_platforms"][0]["torch"] == "0.0.0+elsewhere"
    assert override["platform"]["torch"] == torch.__version__
    # a smoke on this platform: resumed without an override
    smoke(root, capsys)
    code, _, err = run_cli(capsys, "resume", b.id, "-s", root)
    assert code == 0, err
    assert not (study.runs_dir / b.id / "platform-overrides.jsonl").exists()
    assert [len(p["runs"]) for p in platforms_of(Study.open(root), "smoke")] == [1, 1]
