"""`tunelab launch skypilot`: the task file read back by SkyPilot's own loader (`skypilot`,
installed in its own venv, .cache/sky-venv, by `make setup`), then its `run:` section run here
as SkyPilot runs it on one node, SIGKILLed mid-run with its process group, and run again: the
run ends as the uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import kill_group, run_dir_of, tunelab_env, wait_for_checkpoint
from helpers.slurm import free_port
from helpers.train_run import assert_same_result

pytestmark = pytest.mark.skypilot
SKY_VENV = Path(__file__).resolve().parents[3] / ".cache" / "sky-venv"
SKY_PYTHON = SKY_VENV / "bin" / "python"

# SkyPilot's parse of a task file, as JSON (runs in the sky venv)
READ_TASK = """
import json, sys
import sky
out = []
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)
    (res,) = list(task.resources)
    out.append({
        "num_nodes": task.num_nodes, "accelerators": res.accelerators, "disk_size": res.disk_size,
        "use_spot": res.use_spot, "setup": task.setup, "run": task.run, "workdir": task.workdir,
        "file_mounts": task.file_mounts,
        "storage": {k: [s.source, s.mode.value] for k, s in task.storage_mounts.items()},
    })
print(json.dumps(out))
"""


def launch(study: Path, *args: str) -> Path:
    out = study / "launch" / f"{args[args.index('--name') + 1]}.sky.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "tunelab", "launch", "skypilot", "-s", str(study), *args],
        env=tunelab_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def parsed(launch_study) -> dict[str, dict]:
    if not (SKY_VENV / ".installed").exists():
        pytest.skip(f"no SkyPilot venv at {SKY_VENV} (`make setup` creates it)")
    files = {
        "one": launch(launch_study, "--name", "sky-job", "--port", str(free_port())),
        "two": launch(launch_study, "--name", "big", "--nodes", "2", "--gpus-per-node", "4",
                      "--spot", "--bucket", "s3://tunelab-test/study", "--disk-gb", "512"),
    }  # fmt: skip
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", READ_TASK, *map(str, files.values())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(files, json.loads(done.stdout.splitlines()[-1]), strict=True))


def test_skypilot_reads_resources_nodes_setup_and_run(parsed, launch_study, tiny_llama_dir):
    one, two = parsed["one"], parsed["two"]
    # the plan: 2 x H100-SXM (SkyPilot's H100), one node
    assert one["num_nodes"] == 1 and one["accelerators"] == {"H100": 2}
    assert one["disk_size"] == 256 and not one["use_spot"]
    assert one["workdir"] == str(launch_study)
    assert one["file_mounts"] == {str(tiny_llama_dir): str(tiny_llama_dir)}  # the base, outside
    assert 'pip install "torch==2.13.0"' in one["setup"] and "pip install" in one["setup"]
    for word in ("--name sky-job --resume-if-exists", "--strategy ddp",
                 '--nproc "$SKYPILOT_NUM_GPUS_PER_NODE"', '--nnodes "$SKYPILOT_NUM_NODES"',
                 '--node-rank "$SKYPILOT_NODE_RANK"', 'echo "$SKYPILOT_NODE_IPS" | head -n 1'):  # fmt: skip
        assert word in one["run"], word
    # overridden: two nodes of 4, spot, the study in a bucket
    assert two["num_nodes"] == 2 and two["accelerators"] == {"H100": 4}
    assert two["use_spot"] and two["disk_size"] == 512 and two["workdir"] is None
    assert two["storage"] == {"/tunelab/study": ["s3://tunelab-test/study", "MOUNT_CACHED"]}
    assert "--study /tunelab/study" in two["run"]


@pytest.mark.distributed
def test_run_section_killed_then_run_again_ends_as_the_straight_run(
    parsed, launch_study, straight_run, tmp_path
):
    env = tunelab_env(
        SKYPILOT_NODE_RANK="0",
        SKYPILOT_NODE_IPS="127.0.0.1\n",
        SKYPILOT_NUM_NODES="1",
        SKYPILOT_NUM_GPUS_PER_NODE="2",
    )

    log = tmp_path / "run.log"

    def start() -> subprocess.Popen:
        # SkyPilot runs `run:` with bash in the synced workdir
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["bash", "-c", parsed["one"]["run"]], cwd=launch_study, env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    first = start()
    run_dir = wait_for_checkpoint(launch_study, "sky-job", 2)
    kill_group(first)
    from tunelab.core.records import read_json

    assert read_json(run_dir / "status.json")["status"] != "completed"  # stopped mid-run

    again = start()
    assert again.wait(600) == 0, log.read_text()[-3000:]
    assert run_dir_of(launch_study, "sky-job") == run_dir  # the same run, resumed
    assert read_json(run_dir / "status.json")["status"] == "completed"
    assert_same_result(run_dir, straight_run)
