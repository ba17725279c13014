"""Evaluating an adapted model merged: a merged copy in memory, checked on the first batch.

An unmerged LoRA adapter adds two small matmuls to every adapted layer at every decoding step;
merged into the weights (W + scale * B @ A) the model runs as fast as its base. Evaluation,
verify and the smoke's evaluation pass therefore evaluate a merged copy built in memory (the
checkpoint on disk is never touched; only the weights the merge writes into are copied, every
other tensor is shared with the model as loaded). On a CPU the copy's linear layers are packed for
oneDNN as well (`tunelab.packed_linear`), under the same check.

Merging reorders float sums, so it is adopted only after the first batch gave the same answers
both ways: for a generating task, the model as loaded, fed the merged copy's outputs in one
forward pass (teacher forcing), must pick every one of their tokens greedily and end where they
end (`tunelab.generation.greedy_agreement`); for a classifier, every score within `SCORE_ATOL`
of the precision (the tolerance verify reproduces recorded scores with) and the same best label.
Otherwise the evaluation falls back to the model as loaded and records why. The evaluation
record's `merge` says which model was used; `tunelab verify` re-evaluates with that choice.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
# (what the unmerged model gave, what the merged copy gave) -> (same?, max difference, detail)
Comparison = Callable[[T, T], tuple[bool, float | None, str]]


def lora_layers(model: Any) -> list[Any]:
    """The peft LoRA layers of `model` (empty for a model without a LoRA adapter)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def unmergeable_reason(model: Any) -> str | None:
    """Why `model` cannot be evaluated merged (None when it can)."""
    if not hasattr(model, "merge_and_unload"):
        return "the model has no adapter to merge"
    layers = lora_layers(model)
    if not layers:
        return "the model has no LoRA layer to merge"
    for layer in layers:
        weight = getattr(layer.get_base_layer(), "weight", None)
        if weight is None or not weight.dtype.is_floating_point:
            return "the base weights are quantized: merging would round them"
    return None


def merged_copy(model: Any) -> Any:
    """A merged copy of a peft LoRA model: the base weights of the LoRA layers are copied and
    the adapter merged into them; every other tensor is shared with `model`, which is left as it
    was (its adapter unmerged)."""
    import torch

    written = set()
    for layer in lora_layers(model):
        for tensor in layer.get_base_layer().parameters(recurse=False):
            written.add(id(tensor))
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in written:
            memo[id(tensor)] = tensor
    with torch.no_grad():
        twin = copy.deepcopy(model, memo)
        merged = twin.merge_and_unload()
    merged.eval()
    return merged


@dataclass
class EvalModels:
    """The model each evaluation batch runs on.

    `choice` None: the first batch runs on the model as loaded and on the merged copy, and the
    copy is kept only if `compare` finds the same answers; True: the merged copy throughout (a
    recorded choice reproduced); False: the model as loaded.
    """

    model: Any
    choice: bool | None = None
    atol: float = 2e-4
    record: dict[str, Any] = field(default_factory=dict)
    _merged: Any = None
    _checked: bool = False

    @classmethod
    def prepare(cls, model: Any, choice: bool | None, atol: float, rows: int) -> EvalModels:
        """Build the merged copy when the model has an adapter and `choice` allows it; on a
        CPU its linear layers are packed for oneDNN too (`rows`: the batch, the layout's hint)."""
        from tunelab.packed_linear import pack_linears, packing_unavailable

        reason = unmergeable_reason(model)
        if reason is not None or choice is False:
            why = reason or "the recorded evaluation was unmerged"
            return cls(model, False, atol, {"merged": False, "reason": why})
        started = time.perf_counter()
        merged = merged_copy(model)
        out = cls(model, choice, atol, {"merged": choice, "merge_s": 0.0})
        unpacked = packing_unavailable(merged)
        out.record["packed"] = (
            {"linears": 0, "reason": unpacked}
            if unpacked
            else {"linears": pack_linears(merged, rows), "kernel": "onednn"}
        )
        out._merged = merged
        out.record["merge_s"] = round(time.perf_counter() - started, 3)
        if choice:
            out.record["reason"] = "the recorded evaluation was merged"
            out._checked = True
        return out

    @property
    def current(self) -> Any:
        return self._merged if self._merged is not None and self._checked else self.model

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    def run(
        self,
        compute: Callable[[Any], T],
        compare: Comparison | None = None,
        *,
        agrees: Callable[[Any, T], tuple[bool, float | None, str]] | None = None,
    ) -> T:
        """`compute(model)` for one batch on the model chosen. The first batch is checked by
        `compare` (computed on both models, the merged copy's result kept when they agree) or by
        `agrees(model, merged result)` (the model as loaded judges the merged copy's result in
        one pass; the batch is computed again as loaded when it does not agree)."""
        if self._merged is None or self._checked:
            return compute(self.current)
        self._checked = True
        started = time.perf_counter()
        if agrees is not None:
            candidate = compute(self._merged)
            candidate_s = time.perf_counter() - started
            same, diff, detail = agrees(self.model, candidate)
            check_s = time.perf_counter() - started - candidate_s
            reference = None
        else:
            assert compare is not None
            reference = compute(self.model)
            reference_s = time.perf_counter() - started
            candidate = compute(self._merged)
            same, diff, detail = compare(reference, candidate)
            check_s = time.perf_counter() - started - reference_s
        self.record.update(check_s=round(check_s, 3), max_diff=diff, atol=self.atol)
        if same:
            self.record.update(merged=True, reason=f"first batch: {detail}")
            return candidate
        self._merged = None  # the copy is freed: the rest runs as loaded
        self.record.update(merged=False, reason=f"first batch differed merged: {detail}")
        return reference if reference is not None else compute(self.model)


def as_models(model: Any) -> EvalModels:
    """`model` itself when it is an EvalModels, else one that always uses it as given."""
    if isinstance(model, EvalModels):
        return model
    return EvalModels(model, False, record={"merged": False, "reason": "as given"})


def close_scores(atol: float):
    """Scores (one list per row) within `atol`, and the same best label in every row."""

    def compare(reference: list[list[float]], candidate: list[list[float]]):
        diff = max(
            (
                abs(a - b)
                for ra, rb in zip(reference, candidate, strict=True)
                for a, b in zip(ra, rb, strict=True)
            ),
            default=0.0,
        )
        flips = sum(
            1
            for ra, rb in zip(reference, candidate, strict=True)
            if len(ra) > 1 and ra.index(max(ra)) != rb.index(max(rb))
        )
        n = len(reference)
        if diff > atol or flips:
            return (
                False,
                diff,
                f"max score difference {diff:.2g} (atol {atol:g}), {flips} of {n} best labels changed",
            )
        return True, diff, f"{n} rows, max score difference {diff:.2g} (atol {atol:g})"

    return compare
