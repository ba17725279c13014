"""From encoded examples to the micro-batches of each optimizer step.

The data order is a seeded permutation per epoch (seed + epoch), read as one endless stream: an
optimizer step takes the next `micro_batch_size * grad_accum_steps * world_size` indices, so
micro 4 x accumulation 2 sees exactly the examples of micro 8 x accumulation 1. The position in
that stream, `(epoch, index)`, is saved in checkpoints so a resumed run continues where it was.
An example may look different each epoch (`StepSource.views`: augmented images, drawn from the
seed, the epoch and the example), so the position fixes the views too.

`collate(encoded, pad_id, architecture, packing) -> dict` (`input_ids`, `labels`,
`attention_mask` or packed `position_ids`, `num_tokens`; "image": `{pixel_values [b, 3, H, W],
labels [b], num_tokens = b}`). `DataOrder(n, seed)`: a permutation per epoch (`seed + epoch`);
`Position(epoch, index)` is saved in checkpoints; `take_with_epochs(position, n)` gives
`[(epoch, index)]`. `StepSource.next(position) -> (micro_batches, next_position)`
(`step_pairs(position)`: the same micro-batches as (epoch, index) pairs); its
`views(index, epoch)`, when set (`build_loop(..., views=)`), replaces `encoded[index]`
(augmented images).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

IGNORE = -100


@dataclass(frozen=True)
class Position:
    """Where the next optimizer step starts: `index` into epoch `epoch`'s permutation."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Position:
        return cls(int(d["epoch"]), int(d["index"]))


class DataOrder:
    """The seeded order of `num_examples` training examples, epoch after epoch."""

    def __init__(self, num_examples: int, seed: int):
        assert num_examples > 0
        self.num_examples = num_examples
        self.seed = seed
        self._cache: tuple[int, list[int]] | None = None

    def permutation(self, epoch: int) -> list[int]:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._cache = (epoch, torch.randperm(self.num_examples, generator=g).tolist())
        return self._cache[1]

    def take(self, position: Position, count: int) -> tuple[list[int], Position]:
        """The next `count` indices from `position` (crossing epochs) and the position after them."""
        pairs, after = self.take_with_epochs(position, count)
        return [i for _, i in pairs], after

    def take_with_epochs(
        self, position: Position, count: int
    ) -> tuple[list[tuple[int, int]], Position]:
        """As `take`, each index with the epoch it is read in: [(epoch, index)]."""
        out: list[tuple[int, int]] = []
        epoch, index = position.epoch, position.index
        while len(out) < count:
            perm = self.permutation(epoch)
            chunk = perm[index : index + count - len(out)]
            out += [(epoch, i) for i in chunk]
            index += len(chunk)
            if index >= self.num_examples:
                epoch, index = epoch + 1, 0
        return out, Position(epoch, index)

    def epoch_float(self, position: Position) -> float:
        return position.epoch + position.index / self.num_examples


def count_loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Loss positions in a collated batch: shifted labels != -100 (causal LM), or examples."""
    if "labels" in batch and batch["labels"].dim() == 2:
        return int((batch["labels"][:, 1:] != IGNORE).sum())
    return int(batch["labels"].numel())


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding input tokens of a collated batch."""
    return int(batch["num_tokens"])


def collate(
    encoded: Sequence[dict[str, Any]], pad_id: int, architecture: str, packing: bool = False
) -> dict[str, torch.Tensor]:
    """Batch encoded examples.

    causal_lm, padded: `input_ids`, `labels`, `attention_mask`, all [batch, longest] (right
    padding; padded labels are -100). causal_lm, packed (padding-free): one row [1, total] with
    `position_ids` restarting at 0 for each example and no attention mask, so that attention stays
    inside each example (needs sdpa/flash attention and `use_cache=False`); the first label of each
    example is -100, as the shift drops it in the padded form, so both forms have the same loss
    positions. encoder: `input_ids`, `attention_mask` [batch, longest] and `labels` [batch].
    `num_tokens` counts the non-padding input tokens.
    """
    assert encoded, "empty batch"
    if architecture == "image":  # one loss position per image
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in encoded]),  # [b, 3, H, W]
            "labels": torch.tensor([int(e["label"]) for e in encoded]),
            "num_tokens": torch.tensor(len(encoded)),
        }
    lengths = [len(e["input_ids"]) for e in encoded]
    num_tokens = torch.tensor(sum(lengths))
    if architecture == "causal_lm" and packing:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for e in encoded:
            ids += e["input_ids"]
            labels += [IGNORE, *e["labels"][1:]]
            positions += range(len(e["input_ids"]))
        return {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "num_tokens": num_tokens,
        }
    width = max(lengths)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.tensor(e["input_ids"])
        attention_mask[row, :n] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "num_tokens": num_tokens}
    if architecture == "causal_lm":
        labels_t = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
        for row, e in enumerate(encoded):
            labels_t[row, : len(e["labels"])] = torch.tensor(e["labels"])
        batch["labels"] = labels_t
    else:
        batch["labels"] = torch.tensor([int(e["label"]) for e in encoded])
    return batch


def eval_batches(
    encoded: Sequence[dict[str, Any]],
    batch_size: int,
    pad_id: int,
    architecture: str,
    packing: bool,
) -> list[dict[str, torch.Tensor]]:
    """The validation split in order, as collated batches."""
    return [
        collate(encoded[i : i + batch_size], pad_id, architecture, packing)
        for i in range(0, len(encoded), batch_size)
    ]


@dataclass
class StepSource:
    """Yields the micro-batches of each optimizer step from a position in the data order."""

    encoded: Sequence[dict[str, Any]]
    order: DataOrder
    micro_batch_size: int
    grad_accum_steps: int
    pad_id: int
    architecture: str
    packing: bool = False
    world_size: int = 1
    shard: Any = None  # callable(list[int]) -> list[int]: this rank's share of a step
    # (index, epoch) -> the example's view in that epoch (augmented images); None: `encoded`
    views: Callable[[int, int], dict[str, Any]] | None = None

    @property
    def examples_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def step_pairs(self, position: Position) -> tuple[list[list[tuple[int, int]]], Position]:
        """The (epoch, index) pairs of each micro-batch of the step at `position`, and the
        position after it (`tunelab size` reads the worst batch of a run from them)."""
        pairs, after = self.order.take_with_epochs(position, self.examples_per_step)
        if self.shard is not None:  # the share of the step's slots, so each keeps its epoch
            pairs = [pairs[k] for k in self.shard(list(range(len(pairs))))]
        m = self.micro_batch_size
        return [pairs[k : k + m] for k in range(0, len(pairs), m)], after

    def next(self, position: Position) -> tuple[list[dict[str, torch.Tensor]], Position]:
        micro_batches, after = self.step_pairs(position)
        views = self.views
        batches = [
            collate(
                [self.encoded[i] if views is None else views(i, epoch) for epoch, i in pairs],
                self.pad_id,
                self.architecture,
                self.packing,
            )
            for pairs in micro_batches
        ]
        return batches, after
