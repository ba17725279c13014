"""What a sizing child builds for a configuration: the study's model as training builds it, and
synthetic examples of exactly the asked lengths (`measure` and `measure_peaks` use them).

`synthetic_examples(count, seq_len, architecture, *, vocab, ...)`, `build_for(spec, device) ->
(config, base, model, facts)`, `image_side(spec, base, facts)`, `is_oom(exc)`,
`collect(cuda)`.
"""

from __future__ import annotations

import gc
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunelab.core.record_sizing import SizingSpec
from tunelab.core.worker import SPEC
from tunelab.stages.sizing.process_memory import trim_heap

_OOM_WORDS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
)


def synthetic_examples(
    count: int,
    seq_len: int,
    architecture: str,
    *,
    vocab: int,
    num_labels: int = 2,
    loss_fraction: float = 1.0,
    seed: int = 0,
    low_id: int = 5,
    image_size: int | None = None,
) -> list[dict[str, Any]]:
    """`count` encoded examples of exactly `seq_len` tokens, in the Preprocessor's shape.

    causal_lm: the last `loss_fraction` of the positions carry loss (the target after the prompt).
    image: `pixel_values` [3, image_size, image_size] (seq_len is then a ViT's patch tokens or
    a conv net's image side).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    if architecture == "image":
        size = int(image_size or 224)
        return [
            {
                "id": f"synthetic-{i}",
                "pixel_values": torch.randn((3, size, size), generator=g),
                "label": i % max(1, num_labels),
            }
            for i in range(count)
        ]
    hi = max(low_id + 1, vocab)
    out = []
    for i in range(count):
        ids = torch.randint(low_id, hi, (seq_len,), generator=g).tolist()
        e: dict[str, Any] = {"id": f"synthetic-{i}", "input_ids": ids, "truncated": False}
        if architecture == "causal_lm":
            prompt = min(seq_len - 2, max(0, round(seq_len * (1.0 - loss_fraction))))
            e["labels"] = [-100] * prompt + ids[prompt:]
        else:
            e["label"] = i % max(1, num_labels)
        out.append(e)
    return out


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _OOM_WORDS)


def build_for(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any, Any]:
    """Config, base, model (built as training builds it, on `device`), facts."""
    from tunelab.core.config import validate_config
    from tunelab.lib.models import resolve_model
    from tunelab.stages.sizing.facts import model_facts
    from tunelab.stages.train.build import build_model

    typed = spec_of(spec)
    raw = json.loads(json.dumps(typed.config))
    t = raw.setdefault("training", {})  # the study's config section, validated below
    t.update(
        micro_batch_size=typed.micro_batch,
        grad_accum_steps=1 if typed.grad_accum is None else typed.grad_accum,
        precision=t.get("precision", "fp32") if typed.precision is None else typed.precision,
        activation_checkpointing=bool(typed.checkpointing),
        packing=bool(t.get("packing", True) if typed.packing is None else typed.packing),
    )
    cfg = validate_config(raw, source="sizing spec")
    root = Path(typed.root) if typed.root else None
    base = resolve_model(cfg.model, root=root)
    model, _audit = build_model(base, cfg, typed.labels, device)
    lora = cfg.adaptation.method in ("lora", "qlora")
    facts = model_facts(
        model,
        base.architecture,
        lora_rank=cfg.adaptation.rank if lora else 0,
        lora_dropout=cfg.adaptation.dropout if lora else 0.0,
    )
    if facts.conv:  # a conv net's "length" is the side of the images it is fed
        facts = replace(facts, conv={**facts.conv, "image_size": typed.seq_len})
    return cfg, base, model, facts


def spec_of(spec: dict[str, Any]) -> SizingSpec:
    """A configuration's spec (`configurations[i]` of the worker's spec.json), read as its kind."""
    return SizingSpec.of(Path(SPEC), spec, "configuration")


def image_side(spec: dict[str, Any], base: Any, facts: Any) -> int | None:
    """The side of the synthetic images: a conv net's length, else the ViT's config size."""
    return spec_of(spec).seq_len if facts.conv else base.config.get("image_size")


def collect(cuda: bool) -> None:
    """Garbage collected and, on CPU, the heap's free pages returned (`malloc_trim`): what a
    step then takes from the heap faults its pages in again, and the RSS shows it, whatever
    the configurations before it in the process left there."""
    gc.collect()
    if not cuda:
        trim_heap()
