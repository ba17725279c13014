"""Driving the nodes of a several-node run on this machine: one `tunelab train` launcher (a
torchrun agent) per node, their pipes read at once, each node in a process group of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_options(node: int, nnodes: int, endpoint: str) -> list[str]:
    return ["--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-endpoint", endpoint]


def launch_nodes(
    commands: list[list[str]],
    timeout: float,
    envs: list[dict[str, str]] | None = None,
    during: Callable[[list[subprocess.Popen]], None] | None = None,
) -> tuple[list[int | None], list[tuple[str, str]], bool]:
    """Start one command per node, read their pipes at once (a node blocked on a full pipe
    would hold the others at torchrun's exit barrier), call `during(processes)` while they
    run, and wait. Returns (exit codes, [(stdout, stderr)], hung); a hung set is killed,
    process groups and all."""
    envs = envs or [dict(os.environ) for _ in commands]
    nodes = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # each node's launcher, torchrun and ranks in one group
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    outs: list[tuple[str, str]] = [("", "")] * len(nodes)

    def read(k: int) -> None:
        outs[k] = nodes[k].communicate()

    readers = [threading.Thread(target=read, args=(k,), daemon=True) for k in range(len(nodes))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        if during is not None:
            during(nodes)
    finally:
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = any(t.is_alive() for t in readers)
        if hung:
            for p in nodes:
                kill_group(p)
            for t in readers:
                t.join()
    return [p.returncode for p in nodes], outs, hung


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (a node's launcher, torchrun and its ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def said(outs: list[tuple[str, str]], chars: int = 3000) -> str:
    """What every node wrote on stderr (the end of it), for a failure's message."""
    return "\n----\n".join(f"node {k}: {o[1][-chars:]}" for k, o in enumerate(outs))


def wait_for(path: Path, timeout: float) -> None:
    """Wait until `path` exists (e.g. a checkpoint's DONE marker)."""
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.05)
