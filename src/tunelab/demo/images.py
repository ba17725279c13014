"""The image demo's assets: scikit-learn's hand-written digits as PNG files per label, and a small
ViT built from a config.

The digits are real (the UCI set, 1,797 images of 8x8 grey levels 0-16, shipped inside the
scikit-learn wheel: no download) but tiny: written as 8x8 PNGs (levels scaled to 0-255), they
are upscaled by the model's transform chain. No pretrained transformers vision model installs
offline here, so the base is a ViT with random weights built from a config: the study measures
what training it from scratch on the digits gives over its untrained head.
"""

from __future__ import annotations

from pathlib import Path

from tunelab.core.errors import DataError

VIT_IMAGE_SIZE = 16
DIGITS_NOTE = (
    "data: scikit-learn's UCI hand-written digits (1,797 real 8x8 grey images, upscaled to "
    f"{VIT_IMAGE_SIZE}x{VIT_IMAGE_SIZE} by the transform chain); model: a small ViT built from a "
    "config with random weights (no pretrained vision model installs offline)"
)


def load_digits_arrays():
    """(images [n, 8, 8] float 0-16, labels [n]) from the scikit-learn wheel."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError(
            "the image demo reads scikit-learn's digits", hint="pip install 'tunelab[images]'"
        ) from exc
    d = load_digits()
    return d.images, d.target


def write_digits(folder: Path, limit: int | None = None) -> Path:
    """`folder/<digit>/<index>.png` for each image (grey, 8x8, 0-255); `limit` per label."""
    import numpy as np
    from PIL import Image

    images, labels = load_digits_arrays()
    counts: dict[int, int] = {}
    for i, (img, y) in enumerate(zip(images, labels, strict=True)):
        y = int(y)
        if limit is not None and counts.get(y, 0) >= limit:
            continue
        counts[y] = counts.get(y, 0) + 1
        out = folder / str(y)
        out.mkdir(parents=True, exist_ok=True)
        pixels = np.round(img * 255.0 / 16.0).astype(np.uint8)
        Image.fromarray(pixels).save(out / f"{i:04d}.png")  # uint8 [8, 8]: mode L
    return folder


def write_vit(folder: Path) -> Path:
    """The demo's base: a 4-layer ViT (hidden 64, 16x16 images, 4x4 patches), random weights."""
    from tunelab.lib.models._quiet import quiet_transformers
    from tunelab.lib.models.tiny import save_tiny_vit

    with quiet_transformers():  # transformers' notes on image backends and shard writing
        return save_tiny_vit(
            folder, image_size=VIT_IMAGE_SIZE, patch_size=4, hidden=64, layers=4, heads=4, seed=0
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m tunelab.demo.images DIR`: write DIR/digits and DIR/vit-from-config."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tunelab.demo.images DIR", file=sys.stderr)
        return 2
    root = Path(args[0])
    write_digits(root / "digits")
    write_vit(root / "vit-from-config")
    print(f"wrote {root / 'digits'} and {root / 'vit-from-config'}\n{DIGITS_NOTE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
