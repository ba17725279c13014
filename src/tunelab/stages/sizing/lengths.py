"""What the sizing measures at: the study's representative lengths (the training split through
its own preprocessing, or an image model's patch tokens or image side), its label set, and
whether its model can checkpoint activations.
"""

from __future__ import annotations

import time
from typing import Any

from tunelab.core.config_sections import CLASSIFYING_KINDS
from tunelab.core.errors import SnapshotError
from tunelab.core.study import Study


def representative_lengths(study: Study, labels_out: list[Any] | None = None) -> dict[str, Any]:
    """Token counts of the training split after the study's preprocessing (latest snapshot)."""
    from tunelab.lib.models import load_tokenizer, resolve_base
    from tunelab.lib.preprocess.text import Preprocessor, length_stats
    from tunelab.lib.tasks import get_task
    from tunelab.stages.data import load_snapshot

    cfg = study.config
    try:
        snapshot = load_snapshot(study)
    except SnapshotError as exc:
        raise SnapshotError(
            f"no representative lengths: {exc.message}",
            hint="build the snapshot with `tunelab data`, or give lengths with --seq-len 256,512",
        ) from None
    base = resolve_base(study)
    task = get_task(cfg, snapshot.labels)
    if base.architecture == "image":
        return _image_lengths(base, snapshot, task, cfg)
    pre = Preprocessor(load_tokenizer(base), cfg, task, base.architecture)
    started = time.perf_counter()
    encoded = [pre.encode(r) for r in snapshot.rows("train")]
    encode_s = time.perf_counter() - started
    stats = length_stats(encoded)
    if not stats["n"]:
        raise SnapshotError(
            f"snapshot {snapshot.id} has no training examples",
            hint="check data.splits, then `tunelab data`",
        )
    counts = sorted(len(e["input_ids"]) for e in encoded)
    quantiles = [
        counts[min(len(counts) - 1, round(q * (len(counts) - 1) / 100))] for q in range(101)
    ]
    from tunelab.stages.sizing.peaks import evaluation_tokens

    evaluation = evaluation_tokens(pre, snapshot, cfg, base.architecture, counts[-1])
    positions = sum(max(0, len(e["input_ids"]) - 1) for e in encoded)
    loss = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in encoded if "labels" in e)
    return {
        "source": f"snapshot {snapshot.id}",
        "snapshot": snapshot.id,
        **stats,
        "loss_fraction": (loss / positions)
        if positions and base.architecture == "causal_lm"
        else 1.0,
        "labels": list(task.labels) if getattr(task, "labels", None) else None,
        "split_counts": dict(snapshot.manifest.get("counts", {}).get("final", {})),
        "encode_train_s": encode_s,
        "quantiles": quantiles,
        "evaluation_tokens": evaluation,
        # the training examples' lengths in snapshot order, for the worst batch (not recorded)
        "order": [len(e["input_ids"]) for e in encoded],
    }


def conv_image_side(base: Any, cfg: Any) -> int:
    """The side of the square images a conv net is fed in training: the study's image chain
    (`preprocess.image` over the base's processor), its center crop, else its fixed resize."""
    from tunelab.core.errors import ModelError
    from tunelab.lib.models.vision import load_image_processor
    from tunelab.lib.preprocess.images import resolve_chain

    chain = resolve_chain(load_image_processor(base), cfg)
    height, width = chain.crop or (
        (None, None) if chain.shortest_edge else (chain.height, chain.width)
    )
    if height is None or height != width:
        fed = "the shortest edge only" if height is None else f"{width}x{height}"
        raise ModelError(
            f"tunelab size walks a conv net at one square image side; the image chain feeds {fed}",
            hint="set preprocess.image.crop (or preprocess.image.resize) in study.yaml, so "
            "that every image reaches the model at one square size",
        )
    return int(height)


def _image_lengths(base: Any, snapshot: Any, task: Any, cfg: Any) -> dict[str, Any]:
    """An image model's "length": a ViT's patch tokens (at config.image_size), or a conv net's
    image side as the image chain feeds it (one size for all)."""
    from tunelab.core.errors import ModelError
    from tunelab.lib.models.vision import patch_tokens
    from tunelab.stages.sizing.terms import CONV_FAMILIES

    model_type = str(base.config.get("model_type", "")).lower()
    tokens, image_size = patch_tokens(base.config), base.config.get("image_size")
    if model_type in CONV_FAMILIES:  # ConvNeXt's config has a patch_size too (its stem's)
        tokens = image_size = conv_image_side(base, cfg)
    if tokens is None:
        raise ModelError(
            f"tunelab size models image transformers with patch tokens (ViT, DeiT) and the "
            f"conv nets {', '.join(CONV_FAMILIES)}; {model_type!r} is neither (no patch_size)",
            hint="the smoke's record (`tunelab smoke`) has this model's measured step time",
        )
    counts = dict(snapshot.manifest.get("counts", {}).get("final", {}))
    return {
        "source": f"snapshot {snapshot.id}",
        "snapshot": snapshot.id,
        "n": counts.get("train", 0),
        **{k: tokens for k in ("p50", "p95", "max", "mean")},
        "truncated": 0,
        "share_truncated": 0.0,
        "target_truncated": 0,
        "image_size": image_size,
        "length_unit": "image side" if model_type in CONV_FAMILIES else "patch tokens",
        "loss_fraction": 1.0,
        "labels": list(task.labels),
        "split_counts": counts,
        "encode_train_s": 0.0,
        "quantiles": [tokens] * 101,
        "evaluation_tokens": tokens,
        "order": [tokens] * int(counts.get("train", 0)),  # every image at one size
    }


def supports_checkpointing(study: Study) -> bool:
    """Whether the study's model can checkpoint activations: an image classifier's transformers
    class says (ResNet and ConvNeXt cannot); other models are taken to."""
    from tunelab.lib.models import resolve_base

    base = resolve_base(study)
    if base.architecture != "image":
        return True
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.get(str(base.config.get("model_type")))
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(cls, "supports_gradient_checkpointing", True))


def _labels(study: Study) -> list[str] | None:
    cfg = study.config
    if cfg.task.kind not in CLASSIFYING_KINDS:
        return None
    if cfg.task.labels:
        return list(cfg.task.labels)
    from tunelab.stages.data import load_snapshot

    try:
        return list(load_snapshot(study).labels or [])
    except SnapshotError:
        raise SnapshotError(
            "an encoder classifier needs its label set to be sized",
            hint="set task.labels in study.yaml or build the snapshot with `tunelab data`",
        ) from None


def study_lengths(
    study: Study, seq_lens: list[int] | None
) -> tuple[dict[str, Any], list[int], list[str] | None]:
    """(lengths record, the sequence lengths to measure, the label set)."""
    if seq_lens:
        return {"source": "--seq-len", "loss_fraction": 1.0}, sorted(set(seq_lens)), _labels(study)
    lengths = representative_lengths(study)
    sizes = sorted({int(lengths["p95"]), int(lengths["max"])})
    return lengths, sizes, lengths.pop("labels")


def snapshot_lengths(study: Study, sizes: list[int]) -> dict[str, Any]:
    """With --seq-len: the snapshot's lengths for the peaks where there is a snapshot, else
    none for the worst batch and the longest given length for the evaluation."""
    try:
        return representative_lengths(study)
    except SnapshotError:
        return {"evaluation_tokens": sizes[-1]}


def model_architecture(study: Study) -> str:
    from tunelab.lib.models import resolve_base

    return resolve_base(study).architecture
