"""DDP's start: only what training changes is broadcast from rank 0; frozen weights, read by
every rank from the same files, are checked equal instead (two gloo ranks in this machine)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tunelab.core.errors import RunError
from tunelab.stages.train.parallel import start_equal


def _rank(rank: int, store: str, perturb: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same frozen weights on both ranks, as read from one file
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        model[0].requires_grad_(False)
        torch.manual_seed(rank)  # a new head that differs until rank 0's is broadcast
        torch.nn.init.normal_(model[1].weight)
        if perturb and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
        try:
            start_equal(model)
            result = repr(model[1].weight.sum().item())
        except RunError as exc:
            result = f"RunError: {exc}"
        with open(f"{out}-{rank}", "w") as f:
            f.write(result)
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.parametrize("perturb", [False, True])
def test_replicas_start_from_rank_0_and_frozen_weights_must_match(tmp_path, perturb):
    store, out = tempfile.mktemp(dir=tmp_path), str(tmp_path / "out")
    mp.spawn(_rank, args=(store, perturb, out), nprocs=2, join=True)
    said = [open(f"{out}-{r}").read() for r in (0, 1)]
    if perturb:  # every rank stops, naming the rank and the weight
        for s in said:
            assert s.startswith("RunError: rank 1's frozen weight 0.weight differs from rank 0's")
    else:  # the head is rank 0's on both
        assert said[0] == said[1] and not said[0].startswith("RunError")
