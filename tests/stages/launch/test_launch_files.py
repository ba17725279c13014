"""`tunelab launch skypilot|slurm` writes what the engine runs, from the study's plan (2 x
H100-SXM, 3 days of 24 h); bad input is refused with the fix, exit 2, nothing written."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import run_cli, tree_hashes
from tunelab.stages.launch.slurm import time_limit


@pytest.fixture
def study(launch_study, tmp_path) -> Path:
    """A copy of the launch study that a test may change."""
    return Path(shutil.copytree(launch_study, tmp_path / "study", symlinks=True))


def bash_parses(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_slurm_script_from_the_plan(study, capsys):
    code, out, err = run_cli(capsys, "launch", "slurm", "-s", study, "--name", "r16")
    assert code == 0, err
    path = study / "launch" / "r16.sbatch"
    assert f"next: `sbatch {path}`" in out
    text = path.read_text()
    bash_parses(text)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=2",
                      "--time=3-00:00:00", "--requeue", "--job-name=tunelab-r16"):  # fmt: skip
        assert f"#SBATCH {directive}" in lines, directive
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    node = text[text.index("srun ") :]
    for word in ("--ntasks-per-node=1", f"--study {study.resolve()}", "--name r16 --resume-if-exists",
                 "--strategy ddp --nproc 2", '--node-rank "$SLURM_NODEID"',
                 '--rdzv-endpoint "$HEAD_NODE:29500"'):  # fmt: skip
        assert word in node, word
    assert "TUNELAB_DEVICE" not in text  # GPUs: tunelab finds CUDA itself


def test_slurm_overrides_and_quoting(study, capsys):
    why = "same torch build; smoke's pending"
    code, _, err = run_cli(capsys, "launch", "slurm", "-s", study, "--name", "r16", "--nodes", "4",
                           "--gpu", "B200", "--gpus-per-node", "8", "--strategy", "fsdp",
                           "--time-limit-h", "26", "--partition", "gpu", "--why", why)  # fmt: skip
    assert code == 0, err
    text = (study / "launch" / "r16.sbatch").read_text()
    bash_parses(text)
    for directive in ("--nodes=4", "--gpus-per-node=8", "--time=1-02:00:00", "--partition=gpu"):
        assert f"#SBATCH {directive}\n" in text
    assert "# 8 x B200 a node" in text and "--strategy fsdp --nproc 8" in text
    # the reason survives the two levels of quoting: the script's bash -c '...', then its bash
    inner = text[text.index("bash -c ") + len("bash -c ") :].strip()
    node = subprocess.run(["bash", "-c", f"printf %s {inner}"], capture_output=True, text=True)
    words = node.stdout.replace("exec tunelab train", "printf '%s\\n'")
    args = subprocess.run(["bash", "-c", words], capture_output=True, text=True).stdout
    assert args.splitlines()[-2:] == ["--why", why]


def test_skypilot_task_from_the_plan(study, capsys, tiny_llama_dir):
    code, out, err = run_cli(capsys, "launch", "skypilot", "-s", study, "--name", "r16", "--spot")
    assert code == 0, err
    assert "--spot without --bucket" in err  # a recovered node would start the run again
    task = yaml.safe_load((study / "launch" / "r16.sky.yaml").read_text())
    assert task["num_nodes"] == 1 and task["name"] == "tunelab-r16"
    assert task["resources"] == {"accelerators": "H100:2", "disk_size": 256, "use_spot": True}
    assert task["workdir"] == str(study.resolve())
    assert task["file_mounts"] == {str(tiny_llama_dir): str(tiny_llama_dir)}
    assert task["setup"].splitlines()[2] == 'pip install "torch==2.13.0"'
    bash_parses(task["setup"])
    bash_parses(task["run"])
    assert '--rdzv-endpoint "$HEAD_IP:29500"' in task["run"]


def test_torch_build_comes_from_the_records(study):
    """A run's env.json that names a CUDA build decides the torch the nodes install."""
    from tunelab.core.study import Study
    from tunelab.stages.launch.spec import recorded_torch

    s = Study.open(study)
    assert recorded_torch(s).index_url is None  # this machine's CPU build: PyPI's wheel
    run = s.create_run("smoke", env={"torch": "2.13.0+cu128", "cuda": "12.8", "rocm": None})
    build = recorded_torch(s)
    assert build.version == "2.13.0" and build.backend == "cuda 12.8"
    assert build.pip_line() == (
        'pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128'
    )
    assert build.source == str(run.dir / "env.json")


def test_time_limit_rounds_up_to_the_minute():
    assert time_limit(90) == "0-00:02:00"
    assert time_limit(3 * 24 * 3600) == "3-00:00:00"


@pytest.mark.parametrize(
    "args, message, hint",
    [
        (["--gpu", "X100"], "'X100' is not in the GPU catalog", "choose one of"),
        (["--nodes", "0"], "--nodes 0: a job needs at least one node", "--nodes 1"),
        (["--gpus-per-node", "-1"], "--gpus-per-node -1: at least 1", "--gpus-per-node 4"),
        (["--strategy", "zero3"], "--strategy 'zero3': unknown", "ddp, fsdp"),
        (["--time-limit-h", "0"], "--time-limit-h 0: a positive number", "e.g. 24"),
    ],
)
def test_bad_options_are_refused_with_the_fix(study, capsys, args, message, hint):
    before = tree_hashes(study)
    code, _, err = run_cli(capsys, "launch", "slurm", "-s", study, "--name", "r16", *args)
    assert code == 2 and message in err and hint in err, err
    assert tree_hashes(study) == before  # nothing written


@pytest.mark.parametrize("engine", ["slurm", "skypilot"])
def test_without_a_plan_record_the_error_names_the_command(study, capsys, engine):
    shutil.rmtree(study / "records" / "plans")
    code, _, err = run_cli(capsys, "launch", engine, "-s", study, "--name", "r16")
    assert code == 2 and "no plan record" in err and "tunelab plan -s" in err, err
    assert not (study / "launch").exists()


def test_bad_engine_and_name(study, capsys):
    code, _, err = run_cli(capsys, "launch", "kubernetes", "-s", study, "--name", "r16")
    assert code == 2 and "engine 'kubernetes': unknown" in err
    code, _, err = run_cli(capsys, "launch", "slurm", "-s", study, "--name", "a b;rm")
    assert code == 2 and "a run name for a job is" in err
