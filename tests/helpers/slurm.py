"""A real one-node Slurm for tests: munged, slurmctld and slurmd on this machine (Debian's
slurm-wlm and munge), with a slurm.conf, state, spool and logs in a temporary folder.

`start_cluster(folder)` returns a `Cluster` (its `env` points SLURM_CONF at the file) or raises
`ClusterUnavailable` saying why (not root, packages missing, a daemon that would not start);
`Cluster.stop()` ends the daemons it started, by pid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo", "scontrol")


class ClusterUnavailable(Exception):
    """Slurm cannot run here; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(folder: Path, host: str, cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=tunelab-test",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "KillWait=5",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            f"NodeName={host} CPUs={cpus} State=UNKNOWN",
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]
    started: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 30) -> str:
        """A Slurm client command (sbatch, squeue, ...); its stdout."""
        done = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def job_state(self, job_id: str) -> str | None:
        """The job's state while slurmctld still lists it (PENDING, RUNNING, COMPLETED, ...)."""
        out = self.run("scontrol", "show", "job", job_id)
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return None

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Wait until the job left the running states; its final state."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            state = self.job_state(job_id)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return str(state)
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.folder / name).read_text()[-3000:]
            for name in ("slurmctld.log", "slurmd.log")
            if (self.folder / name).exists()
        )

    def stop(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _start_munge(cluster: Cluster) -> None:
    if MUNGE_SOCKET.exists():
        probe = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if probe.returncode == 0:
            return  # a munged already serves this machine
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    proc = subprocess.Popen(
        ["runuser", "-u", "munge", "--", "munged", "--foreground", "--force"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    cluster.started.append(proc)
    _wait(lambda: MUNGE_SOCKET.exists(), 10, "munged", proc)


def _wait(ready, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready():
            return
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise ClusterUnavailable(f"{what} exited with {proc.returncode}: {err[-500:]}")
        time.sleep(0.2)
    raise ClusterUnavailable(f"{what} did not come up in {timeout:.0f} s")


def start_cluster(folder: Path, cpus: int = 2) -> Cluster:
    """munged (unless one runs), slurmctld and slurmd for this host, the node idle."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("a test Slurm runs its daemons as root; this is not root")
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        raise ClusterUnavailable(
            f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; `make setup` "
            "does it as root)"
        )
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, host, cpus))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = Cluster(folder, env)
    try:
        _start_munge(cluster)
        for daemon in ("slurmctld", "slurmd"):
            proc = subprocess.Popen(
                [daemon, "-D", "-f", str(conf)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            cluster.started.append(proc)
            if daemon == "slurmctld":
                _wait(lambda: _answers(cluster), 30, "slurmctld", proc)
        _wait(lambda: _idle(cluster), 30, "slurmd (the node idle)", cluster.started[-1])
    except BaseException as exc:
        logs = cluster.logs()
        cluster.stop()
        if isinstance(exc, ClusterUnavailable):
            raise ClusterUnavailable(f"{exc}\n{logs}") from exc
        raise
    return cluster


def _answers(cluster: Cluster) -> bool:
    try:
        cluster.run("scontrol", "ping", timeout=5)
        return True
    except (RuntimeError, subprocess.TimeoutExpired):
        return False


def _idle(cluster: Cluster) -> bool:
    try:
        return cluster.run("sinfo", "-h", "-o", "%T", timeout=5).strip() == "idle"
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
