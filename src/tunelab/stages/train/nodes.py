"""Several nodes without a shared disk: each node trains from its own copy of the study folder.

Node 0 (the node of global rank 0) holds the records. The other ranks never read or write the
run's folder: what they need of the records (the run to resume, its config overrides, the
checkpoint's state) comes from rank 0 through the process group. What they read from their
own node's copy (study.yaml, the data snapshot, the hypothesis lock, the base model) must be
what node 0 reads: `require_same_copies` compares them before any run exists.

`node_rank()`, `several_nodes(strategy)`, `from_main(strategy, work)` (rank 0 works, every rank
gets its result or its refusal), `copy_fingerprint(prep)` and `require_same_copies(strategy,
fingerprint)`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from tunelab.core import errors
from tunelab.core.errors import RunError, TunelabError
from tunelab.stages.train.strategy import SingleProcess, Strategy

T = TypeVar("T")

# what each node's copy must share with node 0's, and the name a refusal gives it
COPY_PARTS = {
    "snapshot": "data snapshot",
    "hypothesis": "hypothesis lock",
    "config": "config (study.yaml with the --set overrides)",
    "base": "base model files",
}


def node_rank() -> int:
    """This process's node (torchrun's GROUP_RANK; 0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def several_nodes(strategy: Strategy | None) -> bool:
    """Whether the run's ranks span more than one node (torchrun's LOCAL_WORLD_SIZE is the
    ranks of this node)."""
    world = (strategy or SingleProcess()).world_size
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world


def from_main(strategy: Strategy | None, work: Callable[[], T]) -> T:
    """Rank 0 runs `work` (reading node 0's records); every rank returns its result. When rank
    0 refuses (a TunelabError, or any exception), every rank raises the same refusal, so the
    other ranks stop with rank 0 instead of waiting for it at their next collective."""
    strategy = strategy or SingleProcess()
    if strategy.world_size == 1:
        return work()
    if not strategy.is_main:
        kind, payload = strategy.broadcast_object(None)
        if kind == "ok":
            return payload
        name, message, hint = payload
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, TunelabError)):
            cls = RunError
        raise cls(f"rank 0: {message}", hint=hint)
    try:
        result = work()
    except Exception as exc:
        refusal = (
            type(exc).__name__,
            getattr(exc, "message", str(exc)),
            getattr(exc, "hint", None),
        )
        strategy.broadcast_object(("error", refusal))
        raise
    strategy.broadcast_object(("ok", result))
    return result


def copy_fingerprint(prep: Any) -> dict[str, str]:
    """What this node's study copy gives the run (a `Prepared`): the data snapshot's id, the
    hypothesis lock's sha256, the config's sha256 and the base model's."""
    return {
        "snapshot": str(prep.snapshot.id),
        "hypothesis": str(prep.hypothesis.get("sha256")),
        "config": prep.cfg.sha256(),
        "base": str(prep.base.identity.get("sha256")),
    }


def require_same_copies(strategy: Strategy | None, fingerprint: dict[str, str]) -> None:
    """Every rank's `fingerprint` against rank 0's; on a difference every rank raises the same
    RunError naming the node, what differs with both hashes, and the fix. A collective."""
    strategy = strategy or SingleProcess()
    if strategy.world_size == 1:
        return
    mine = {"node": node_rank(), "host": socket.gethostname(), **fingerprint}
    every = strategy.gather_objects(mine)
    main = every[0]
    found = []
    for other in every[1:]:
        for key, what in COPY_PARTS.items():
            if other[key] != main[key]:
                found.append(
                    f"node {other['node']} ({other['host']}): its {what} is {other[key][:16]}, "
                    f"node 0's is {main[key][:16]}"
                )
    if found:
        shown = sorted(set(found))
        raise RunError(
            "the nodes' study folders differ: " + "; ".join(shown[:6]),
            hint="copy the study folder from node 0 to every other node again (e.g. `rsync -a "
            "node0:STUDY/ STUDY/`), with the same data snapshot, hypothesis and base model; "
            "every node must train on what node 0 records",
        )
