"""The forward walk of a hierarchical vision transformer (Swin-style), for the memory model.

A Swin model's blocks are ViT-like (pre-norm, attention, an MLP of `mlp_ratio` x the width),
but its stages differ: stage i works on a grid of patches halved i times on each side, at a
width doubled i times, with `num_heads[i]` heads, and its attention runs inside windows of
`window_size` x `window_size` patches (so [batch x windows] rows of window^2 tokens). Between
stages a patch merging concatenates each 2 x 2 neighbourhood (4 x the width), normalizes it and
reduces it to twice the width.

`stages_of(config) -> [{depth, hidden, heads, grid, window, intermediate}]` (None for a model
without per-stage lists); `enter_layer(trace, i, x) -> x`: before block i of the walk, the
trace takes the stage's width, heads and window rows, patches merged at a stage boundary.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any


def stages_of(config: Any) -> list[dict[str, int]] | None:
    """The per-stage shape of a Swin-style config (depths and num_heads as lists)."""
    depths, heads = getattr(config, "depths", None), getattr(config, "num_heads", None)
    embed = getattr(config, "embed_dim", None)
    if not isinstance(depths, list | tuple) or not isinstance(heads, list | tuple) or not embed:
        return None
    grid = int(config.image_size) // int(config.patch_size)
    ratio = float(getattr(config, "mlp_ratio", 4.0))
    out = []
    for i, (depth, h) in enumerate(zip(depths, heads, strict=True)):
        hidden = int(embed) * 2**i
        out.append(
            {
                "depth": int(depth),
                "hidden": hidden,
                "heads": int(h),
                "grid": max(1, grid // 2**i),
                "window": int(getattr(config, "window_size", 7)),
                "intermediate": int(ratio * hidden),
            }
        )
    return out


def first_width(stages: list[dict[str, int]], batch: int) -> int:
    """Elements of the patch embeddings: [batch, grid^2, first width]."""
    return batch * stages[0]["grid"] ** 2 * stages[0]["hidden"]


def _stage_at(stages: list[dict[str, int]], layer: int) -> tuple[int, bool]:
    """(the stage of block `layer`, whether the block is its stage's first)."""
    first = 0
    for i, st in enumerate(stages):
        if layer < first + st["depth"]:
            return i, layer == first
        first += st["depth"]
    return len(stages) - 1, False


def enter_layer(t: Any, layer: int, x: Any, facts: Any) -> Any:
    """Set the trace for block `layer` (its stage's facts, window rows); at the first block of
    a stage after the first, the patch merging that leads into it. Returns the block input."""
    stages = facts.stages
    i, first = _stage_at(stages, layer)
    st = stages[i]
    t.f = replace(
        facts, hidden=st["hidden"], heads=st["heads"], kv_heads=st["heads"],
        head_dim=st["hidden"] // st["heads"], intermediate=st["intermediate"],
    )  # fmt: skip
    window = min(st["window"], st["grid"])
    per_side = -(-st["grid"] // window)  # the grid is padded to whole windows
    t.rows, t.s = t.c.micro_batch * per_side**2, window * window
    if first and i > 0:
        prev = stages[i - 1]["hidden"]
        tokens = t.c.micro_batch * st["grid"] ** 2
        merged = t.new(tokens * 4 * prev, x.size, x.rg)  # [b, tokens, 4 x previous width]
        x = t.layernorm(merged, None if not x.rg else "weight")
        x = t.linear(x, 4 * prev, st["hidden"], "weight" if x.rg else None)
    return x
