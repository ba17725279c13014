"""How image bytes become the picture a model reads: decoded in full, upright, in RGB.

Shared by the data stage (which reads, hashes and checks every file), the image chain of
preprocessing, inspect, export and the dossier, so that each decodes a file exactly as the
snapshot did.

- `decode_image(bytes, where) -> (image, EXIF orientation)`: decoded completely (a truncated
  file fails here), one frame only, turned upright by its EXIF orientation (as transformers'
  `load_image` and `datasets`' Image read it); DataError naming `where`.
- `open_image(bytes, where)`: the upright image alone.
- `model_rgb(image)`: transformers' `convert_to_rgb`, transparency composited onto white.
- `ACCEPTED_MODES`: the Pillow modes that convert to RGB without losing the picture;
  `ORIENTED`: the `Image.info` key naming the EXIF orientation applied.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

from tunelab.core.errors import DataError

# Pillow modes that convert to RGB without losing the picture (16-bit and float modes do not)
ACCEPTED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
EXIF_ORIENTATION = 0x0112
ORIENTED = "tunelab_exif_orientation"  # Image.info key: the EXIF orientation applied when read


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow comes with the images extra
        raise DataError("image data needs Pillow", hint="pip install 'tunelab[images]'") from exc
    return Image


_REPLACE = "replace the file, or remove it"


def _unreadable(where: str, data: bytes, exc: Exception) -> DataError:
    """The DataError for bytes Pillow cannot decode, saying what is wrong with them."""
    Image = _pil()
    if not data:
        return DataError(f"{where}: an empty file (0 bytes)", hint=_REPLACE)
    if isinstance(exc, Image.DecompressionBombError):
        return DataError(
            f"{where}: too large to decode safely ({exc})",
            hint="a damaged or hostile header, or a huge picture: downscale it (a model reads a "
            f"few hundred pixels a side), or {_REPLACE}",
        )
    if isinstance(exc, Image.UnidentifiedImageError):
        return DataError(
            f"{where}: not a readable image, of no format Pillow knows ({len(data):,} bytes "
            f"starting {data[:8]!r})",
            hint=f"PNG, JPEG, WebP, BMP, TIFF and GIF are read: convert it, or {_REPLACE}",
        )
    return DataError(
        f"{where}: not a readable image, cut short or damaged (Pillow: {type(exc).__name__}: {exc})",
        hint=f"copy the file again from where it came from, or {_REPLACE}",
    )


def decode_image(data: bytes, where: str) -> tuple[Any, int]:
    """(image, EXIF orientation) of `data`, decoded completely (a truncated file fails here) and
    turned upright by its EXIF orientation; DataError naming `where`."""
    Image = _pil()
    try:
        with warnings.catch_warnings():  # a large picture is read; its size is recorded
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as probe:
                probe.verify()  # structure and checksums, without decoding
            img = Image.open(io.BytesIO(data))
            img.load()  # every pixel: catches a file cut short
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for bad files
        raise _unreadable(where, data, exc) from None
    frames = getattr(img, "n_frames", 1)
    if frames > 1:
        raise DataError(
            f"{where}: an animated {img.format} of {frames} frames; a classifier reads one picture",
            hint="save the frame you mean as its own file (Pillow: `im.seek(i); "
            f"im.save('frame.png')`), or {_REPLACE}",
        )
    orientation = int(img.getexif().get(EXIF_ORIENTATION) or 1)
    if orientation != 1:
        from PIL import ImageOps

        fmt = img.format
        img = ImageOps.exif_transpose(img)
        img.format = fmt
        img.info[ORIENTED] = orientation  # for inspect to say so
    return img, orientation


def open_image(data: bytes, where: str):
    """The upright image of `data`, decoded in full; DataError naming `where`."""
    return decode_image(data, where)[0]


def model_rgb(img: Any) -> Any:
    """The RGB image a model reads, as transformers' `convert_to_rgb` makes it: transparency
    (an alpha band or a palette's transparent colour) composited onto white."""
    Image = _pil()
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
