"""A rank's allocator policy: glibc's mmap threshold fixed at 256 KiB unless the user asks for
glibc's own (benchmarks/fsdp_load.py measures what it saves). Each case in a child process, so
the test process keeps its own policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = "from tunelab.stages.train.process_group import return_freed_blocks as r; print(r())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("policy, applied", [(None, "True"), ("default", "False")])
def test_ranks_return_freed_blocks_unless_told_to_keep_glibcs_policy(policy, applied):
    env = {k: v for k, v in os.environ.items() if k != "TUNELAB_RANK_MALLOC"}
    if policy:
        env["TUNELAB_RANK_MALLOC"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == applied
