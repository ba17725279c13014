"""`tunelab launch slurm` on a real one-node Slurm (Debian's slurm-wlm and munge, the daemons
started here): the generated script, submitted with sbatch, trains 2 CPU ranks; cancelled
mid-run and submitted again, it resumes the run to the uninterrupted result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import run_dir_of, tunelab_env, wait_for_checkpoint
from helpers.slurm import ClusterUnavailable, free_port, start_cluster
from helpers.train_run import assert_same_result

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as exc:
        pytest.skip(f"no test Slurm: {exc}")
    cluster.env = tunelab_env(SLURM_CONF=cluster.env["SLURM_CONF"])
    yield cluster
    cluster.stop()


def write_script(study: Path, name: str) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "tunelab", "launch", "slurm", "-s", str(study), "--name", name,
         "--cpu-ranks", "2", "--time-limit-h", "0.5", "--port", str(free_port()), "--json"],
        env=tunelab_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return study / "launch" / f"{name}.sbatch"


def test_sbatch_cancel_resubmit_resumes_to_the_straight_result(cluster, launch_study, straight_run):
    script = write_script(launch_study, "slurm-job")
    text = script.read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --cpus-per-task=2", "#SBATCH --requeue",
                 "#SBATCH --time=0-00:30:00", "scontrol show hostnames"):  # fmt: skip
        assert line in text

    first = cluster.run("sbatch", "--parsable", str(script)).strip()
    run_dir = wait_for_checkpoint(launch_study, "slurm-job", 2)
    cluster.run("scancel", first)
    state = cluster.wait_job(first, 120)
    assert state == "CANCELLED", cluster.logs()
    from tunelab.core.records import read_json

    assert read_json(run_dir / "status.json")["status"] != "completed"  # stopped mid-run

    second = cluster.run("sbatch", "--parsable", str(script)).strip()
    state = cluster.wait_job(second, 600)
    log = (launch_study / "launch" / f"slurm-job-{second}.out").read_text()
    assert state == "COMPLETED", log[-3000:] + cluster.logs()
    assert run_dir_of(launch_study, "slurm-job") == run_dir  # the same run, resumed
    assert read_json(run_dir / "status.json")["status"] == "completed"
    assert_same_result(run_dir, straight_run)
