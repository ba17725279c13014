"""Evaluating on a copy made for the evaluation: merged, packed, checked on the first batch.

An unmerged LoRA adapter adds two small matmuls to every adapted layer at every decoding step;
merged into the weights (W + scale * B @ A) the model runs as fast as its base. Evaluation,
verify and the smoke's evaluation pass therefore evaluate a copy built in memory (the checkpoint
on disk is never touched; only the weights the merge writes into are copied, every other tensor
is shared with the model as loaded). On a CPU the copy's linear layers are packed for oneDNN as
well (`tunelab.lib.inference.packed_linear`); a model without an adapter (a baseline, a full fine-tune) gets
a copy for that alone, when its layers can be packed and the memory free holds the packed weights.

Merging and packing reorder float sums, so the copy is adopted only after the first batch gave
the same answers both ways: for a generating task, the model as loaded, fed the copy's outputs
in one forward pass (teacher forcing), must pick every one of their tokens greedily and end
where they end (`tunelab.lib.inference.generation.greedy_agreement`); for a classifier, every score within
`SCORE_ATOL` of the precision (the tolerance verify reproduces recorded scores with) and the
same best label. Otherwise the evaluation falls back to the model as loaded and records why.
The evaluation record's `merge` says which model was used (`copy`, `merged`, `packed`);
`tunelab verify` re-evaluates with that choice.

`ran_on_copy(merge)` reads a record's `merge` (also one without `copy`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
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


def _copy_sharing(model: Any, written: set[int]) -> Any:
    """A copy of `model`'s modules sharing every parameter and buffer but those in `written`
    (ids), which are copied."""
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in written:
            memo[id(tensor)] = tensor
    return copy.deepcopy(model, memo)


def merged_copy(model: Any) -> Any:
    """A merged copy of a peft LoRA model: the base weights of the LoRA layers are copied and
    the adapter merged into them; every other tensor is shared with `model`, which is left as it
    was (its adapter unmerged)."""
    import torch

    written = set()
    for layer in lora_layers(model):
        for tensor in layer.get_base_layer().parameters(recurse=False):
            written.add(id(tensor))
    with torch.no_grad():
        merged = _copy_sharing(model, written).merge_and_unload()
    merged.eval()
    return merged


def evaluation_copy(model: Any) -> tuple[Any, bool, str | None]:
    """(the copy to evaluate, whether it is merged, why it is not): the merged copy of a model
    whose LoRA adapter can be merged; of a model without one, a copy of its modules sharing
    every tensor (its linear layers are then packed); None for an adapter that cannot be
    merged (its layers read their own weights, which packing replaces)."""
    reason = unmergeable_reason(model)
    if reason is None:
        return merged_copy(model), True, None
    if lora_layers(model):
        return None, False, reason
    twin = _copy_sharing(model, set())
    twin.eval()
    return twin, False, reason


def packing_refused(model: Any) -> str | None:
    """Why `model`'s linear layers are not packed (None when they are): the packed weights are
    a second copy of every linear weight, refused when the memory free now cannot hold it
    twice over."""
    from tunelab.core.env import available_memory_bytes
    from tunelab.lib.inference.packed_linear import packed_bytes, packing_unavailable

    unavailable = packing_unavailable(model)
    if unavailable:
        return unavailable
    need, free = packed_bytes(model), available_memory_bytes()
    if free is not None and 2 * need > free:
        mib = 2**20
        return (
            f"the packed weights ({need / mib:,.0f} MiB) need twice that free, "
            f"{free / mib:,.0f} MiB is"
        )
    return None


def pack_copy(model: Any, rows: int) -> dict[str, Any]:
    """Pack `model`'s linear layers in place when `packing_refused` allows it; returns the
    record's `packed`: {linears, kernel}, or {linears: 0, reason}."""
    from tunelab.lib.inference.packed_linear import pack_linears

    refused = packing_refused(model)
    if refused is None:
        try:
            return {"linears": pack_linears(model, rows), "kernel": "onednn"}
        except RuntimeError as exc:  # a CPU whose oneDNN build has no such layout
            first = (str(exc).splitlines() or [""])[0]
            refused = f"oneDNN refused to pack a weight: {first}"
    return {"linears": 0, "reason": refused}


@dataclass
class EvalModels:
    """The model each evaluation batch runs on: the model as loaded, or a copy of it made for
    the evaluation (merged, when it has a LoRA adapter, and on a CPU its linear layers packed).

    `choice` None: the first batch runs on the model as loaded and on the copy, and the copy is
    kept only if the check finds the same answers; True: the copy throughout (a recorded choice
    reproduced); False: the model as loaded.
    """

    model: Any
    choice: bool | None = None
    atol: float = 2e-4
    record: dict[str, Any] = field(default_factory=dict)
    _copy: Any = None
    _merges: bool = False
    _checked: bool = False

    @classmethod
    def prepare(cls, model: Any, choice: bool | None, atol: float, rows: int) -> EvalModels:
        """Build the evaluation copy when `choice` allows it: merged when the model has an
        adapter, its linear layers packed for oneDNN on a CPU (`rows`: the batch, the layout's
        hint). A model without an adapter whose layers cannot be packed gets no copy."""
        if choice is False:
            why = "the recorded evaluation ran on the model as loaded"
            return cls(model, False, atol, {"merged": False, "copy": False, "reason": why})
        started = time.perf_counter()
        twin, merges, reason = evaluation_copy(model)
        if twin is None:
            return cls(model, False, atol, {"merged": False, "copy": False, "reason": reason})
        packed = pack_copy(twin, rows)
        if not packed["linears"] and not merges:  # a copy for nothing: run as loaded
            record = {"merged": False, "copy": False, "reason": reason, "packed": packed}
            return cls(model, False, atol, record)
        out = cls(model, choice, atol, {"merged": bool(choice and merges), "copy": bool(choice)})
        out.record["packed"] = packed
        out._copy, out._merges = twin, merges
        out.record["merge_s"] = round(time.perf_counter() - started, 3)
        if not merges:
            out.record["unmerged"] = reason
        if choice:
            out.record["reason"] = "the recorded evaluation ran on its copy"
            out._checked = True
        return out

    @property
    def current(self) -> Any:
        return self._copy if self._copy is not None and self._checked else self.model

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
        `compare` (computed on both models, the copy's result kept when they agree) or by
        `agrees(model, copy's result)` (the model as loaded judges the copy's result in one
        pass; the batch is computed again as loaded when it does not agree)."""
        if self._copy is None or self._checked:
            return compute(self.current)
        self._checked = True
        started = time.perf_counter()
        if agrees is not None:
            candidate = compute(self._copy)
            candidate_s = time.perf_counter() - started
            same, diff, detail = agrees(self.model, candidate)
            check_s = time.perf_counter() - started - candidate_s
            reference = None
        else:
            assert compare is not None
            reference = compute(self.model)
            reference_s = time.perf_counter() - started
            candidate = compute(self._copy)
            same, diff, detail = compare(reference, candidate)
            check_s = time.perf_counter() - started - reference_s
        self.record.update(check_s=round(check_s, 3), max_diff=diff, atol=self.atol)
        if same:
            self.record.update(merged=self._merges, copy=True, reason=f"first batch: {detail}")
            return candidate
        self._copy = None  # the copy is freed: the rest runs as loaded
        self.record.update(
            merged=False, copy=False, reason=f"first batch differed on the copy: {detail}"
        )
        return reference if reference is not None else compute(self.model)


def as_models(model: Any) -> EvalModels:
    """`model` itself when it is an EvalModels, else one that always uses it as given."""
    if isinstance(model, EvalModels):
        return model
    return EvalModels(model, False, record={"merged": False, "copy": False, "reason": "as given"})


def ran_on_copy(merge_record: Mapping[str, Any] | None) -> bool:
    """Whether an evaluation record's `merge` says it ran on the evaluation copy (a record
    without `copy` had one only when merged)."""
    merge = merge_record or {}
    return bool(merge.get("copy", merge.get("merged")))


def describe_copy(merge_record: Mapping[str, Any]) -> str:
    """What an evaluation ran on, in a few words, from its record's `merge`."""
    merge = merge_record or {}
    if not ran_on_copy(merge):
        return f"the model as loaded: {merge.get('reason') or 'no copy'}"
    packed = (merge.get("packed") or {}).get("linears") or 0
    if merge.get("merged"):
        return f"merged copy, {packed} linear layers packed" if packed else "merged copy"
    return f"copy with {packed} linear layers packed"


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
