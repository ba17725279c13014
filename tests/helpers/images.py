"""Coloured test images and image-classification studies built from them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": 0, "green": 1, "blue": 2}


def colour_image(channel: int, seed: int, size: tuple[int, int] = (24, 20)) -> Image.Image:
    """A noisy image whose `channel` is bright: a trained head tells the colours apart."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 80, size=(size[1], size[0], 3), dtype=np.uint8)
    a[..., channel] = rng.integers(150, 256, size=(size[1], size[0]), dtype=np.uint8)
    return Image.fromarray(a)


def png_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def write_colour_folder(data: Path, per_label: int = 12) -> Path:
    for label, channel in COLOURS.items():
        (data / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_label):
            colour_image(channel, 100 * channel + i).save(data / label / f"{i}.png")
    return data


def write_image_study(
    root: Path,
    model_dir: Path,
    source: dict,
    set: dict | None = None,  # noqa: A002 - named for `tunelab --set`
    **sections,
) -> Path:
    """An image-classification study over `source` on a tiny ViT; `set` sets dotted paths over
    the fixed ones (`{"data.fields": {"image": "path"}}`); `sections` replace the sections of
    the same name."""
    from helpers.study import build_study

    fixed = {
        "task.kind": "image_classification",
        "guardrails": [COLOUR_GUARDRAIL],
        "data.source": source,
        "data.dedup.threshold": 0.95,
        "adaptation.method": "lora",
        "adaptation.target_modules": ["q_proj", "v_proj"],
        "training.max_steps": 3,
        "training.micro_batch_size": 8,
        "training.lr": 0.01,
        "evaluation.batch_size": 16,
        "evaluation.bootstrap_samples": 100,
    }
    fixed = {k: v for k, v in fixed.items() if k.split(".")[0] not in sections}
    return build_study(
        root,
        template=False,
        name="colours",
        hypothesis=COLOURS_HYPOTHESIS,
        model_dir=model_dir,
        set=fixed | (set or {}),
        **sections,
    )


COLOURS_HYPOTHESIS = {
    "behaviour": "tell the dominant colour",
    "rationale": "the head is new",
    "expected_effect": "macro_f1 +0.3",
    "primary_metric": "macro_f1",
}
COLOUR_GUARDRAIL = {
    "metric": "f1",
    "scope": "every_category",
    "op": ">=",
    "value": -0.5,
    "relative_to": "baseline",
}
