"""The platform gate: `train` and `resume` refuse on a platform where no smoke or no baseline of
the study passed (a study with neither included), naming `tunelab smoke` and `tunelab
baseline`; a smoke and a baseline here let them go on, and so does `--other-platform` with its
`--why` recorded. Another platform is simulated by editing the torch version that the passing
runs' env.json recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_cli, train_stopped_at, tree_hashes, write_email_study
from tunelab.core.records import read_json, read_jsonl
from tunelab.core.study import Study
from tunelab.stages.report.collect import collect
from tunelab.stages.report.document import render_markdown
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.sections.platforms import platforms_section
from tunelab.stages.smoke.platform import WHY_ENV, check_platform, platforms_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def gated(monkeypatch):
    """The gate on (the suite's conftest lets other tests past it)."""
    monkeypatch.delenv(WHY_ENV, raising=False)


def stage(root: Path, capsys, command: str, *args: str) -> str:
    code, out, err = run_cli(capsys, command, "-s", root, "--json", *args)
    assert code == 0, err
    return json.loads(out)["run_id"]


def smoke(root: Path, capsys) -> str:
    return stage(root, capsys, "smoke", "--train-examples", "4", "--steps", "1",
                 "--eval-examples", "2")  # fmt: skip


def move_elsewhere(study: Study, kind: str, torch_version: str = "0.0.0+elsewhere") -> None:
    for row in study.ledger.list_runs(kind):
        env_path = study.runs_dir / row.id / "env.json"
        env = read_json(env_path)
        env["torch"] = torch_version
        env_path.write_text(json.dumps(env))


def refused(capsys, root: Path, *args: str) -> str:
    """Run a command the gate must refuse: exit 2, records untouched; returns its message."""
    before = tree_hashes(root / "records")
    code, _, err = run_cli(capsys, *args, "-s", root)
    assert code == 2, err
    assert tree_hashes(root / "records") == before
    return " ".join(err.split())


@pytest.mark.processes
def test_train_and_resume_across_platforms(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    root = write_email_study(tmp_path / "s", tiny_llama_dir, "platform", max_steps=4,
                             eval_every_steps=0, checkpoint_every_steps=2)  # fmt: skip
    study = Study.open(root)
    # a study with neither check: both commands named
    text = refused(capsys, root, "train", "--name", "early")
    assert "no smoke passed in this study; no baseline passed in this study" in text
    assert f"`tunelab smoke -s {root}` and `tunelab baseline -s {root}`" in text
    baseline = stage(root, capsys, "baseline")
    first_smoke = smoke(root, capsys)
    a = train_stopped_at(study, 3, "a")
    b = train_stopped_at(study, 3, "b")
    gate = study.get_run(a.id).record.get("platform_gate")
    assert (gate["smoke"], gate["baseline"], "override" in gate) == (first_smoke, baseline, False)
    # the smoke moved to another platform: the smoke is named, the baseline is not
    move_elsewhere(study, "smoke")
    for args in (["resume", a.id], ["train", "--name", "c"]):
        text = refused(capsys, root, *args)
        assert "`tunelab smoke -s" in text and "`tunelab baseline" not in text
        assert f"smoke {first_smoke} passed on another (torch 0.0.0+elsewhere -> " in text
    assert "--why" in refused(capsys, root, "resume", a.id, "--other-platform")
    # the baseline too: both named
    move_elsewhere(study, "baseline")
    text = refused(capsys, root, "resume", a.id)
    assert f"baseline {baseline} passed on another" in text and "`tunelab baseline -s" in text
    assert Study.open(root).ledger.get_run(a.id).status == "interrupted"
    # the override goes on, its reason recorded with the run
    code, _, err = run_cli(capsys, "resume", a.id, "-s", root, "--other-platform",
                           "--why", "the smoke is queued")  # fmt: skip
    assert code == 0, err
    (line,) = read_jsonl(study.runs_dir / a.id / "platforms.jsonl")
    override = line["override"]
    assert (override["why"], override["source"]) == ("the smoke is queued", "--why")
    assert override["missing"]["smoke"][0]["torch"] == "0.0.0+elsewhere"
    assert override["missing"]["baseline"][0]["torch"] == "0.0.0+elsewhere"
    assert line["platform"]["torch"] == torch.__version__
    # a smoke and a baseline on this platform: resumed without an override
    new_smoke, new_baseline = smoke(root, capsys), stage(root, capsys, "baseline")
    code, _, err = run_cli(capsys, "resume", b.id, "-s", root)
    assert code == 0, err
    (line,) = read_jsonl(study.runs_dir / b.id / "platforms.jsonl")
    assert (line["smoke"], line["baseline"], "override" in line) == (new_smoke, new_baseline, False)
    assert [len(p["runs"]) for p in platforms_of(Study.open(root), "smoke")] == [1, 1]
    check_dossier(study)
    # the environment's reason is an override like --why, its source recorded
    move_elsewhere(study, "smoke")
    monkeypatch.setenv(WHY_ENV, "pipeline runs the smoke elsewhere")
    assert check_platform(study, "train", None)["override"]["source"] == WHY_ENV


def platforms_markdown(study: Study) -> str:
    section = platforms_section(Dossier(study, collect(study), study.root))
    return render_markdown("dossier", [section], study.root)


def check_dossier(study: Study) -> None:
    """The dossier's Platforms section: one column per platform, at most 80 columns a line,
    the stages that ran there, and the override with its reason."""
    md = platforms_markdown(study)
    tables = [line for line in md.splitlines() if line.startswith("|")]
    assert tables[0].split("|")[2:4] == [" P1 ", " P2 "]
    # the first smoke and baseline were moved, the second ones not; training ran here
    for row in (
        "| smoke | 1 run | 1 run |",
        "| baseline | 1 run | 1 run |",
        "| train | - | 2 runs |",
    ):
        assert row in md
    assert "(resume) went past the platform gate without smoke and baseline" in md
    assert "the smoke is queued" in md
    # many platforms: as many tables as it takes to stay within 80 columns
    for i, kind in enumerate(("train", "smoke", "baseline")):
        move_elsewhere(study, kind, f"2.{i}.0+cu128.a-long-local-build-tag")
    md = platforms_markdown(study)
    assert max(len(line) for line in md.splitlines() if line.startswith("|")) <= 80
    headers = [line for line in md.splitlines() if line.startswith("|  |")]
    assert headers == ["|  | P1 | P2 |", "|  | P3 | P4 |"]
    assert "2.0.0+cu128.a-long-loca…" in md  # shortened; the HTML shows it whole on hover
