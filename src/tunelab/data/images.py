"""Image data: reading image files, their facts (size, mode, format), content hashes and
duplicates.

An image example is the usual example dict plus `image` (the file's name inside the snapshot,
`images/<sha256>.<ext>`, where its original bytes are stored) and `image_sha256`; its `text` is
the file's path inside the source, for people to read. Sources: a folder per label (PNG, JPEG,
WebP, BMP, TIFF), or JSONL / CSV / Parquet with a column of paths (`data.fields.image`, relative
to the data file's folder). Every file is decoded in full when read, so an unreadable or
truncated file is named before anything is written.

Duplicates: exact when the decoded pixels are equal (sha256 of the RGB(A) pixels and the size:
a PNG re-saved as BMP or WebP-lossless counts), near when the 64-bit difference hashes (dHash)
of two images differ in few bits: similarity = 1 - Hamming distance / 64, compared with
`data.dedup.threshold`.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunelab.config import DataConfig
from tunelab.data.dedup import DuplicatePair, exact_group_ids
from tunelab.data.readers import SourceData, SourceRow, _contained, _record_file, _rel
from tunelab.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
HASH_BITS = 64
DHASH_VERSION = 1
# rows compared at once in the near-duplicate search ([block, n] uint64 XORs)
BLOCK_ROWS = 1024


@dataclass(frozen=True)
class ImageFacts:
    """What reading an image file found: file and pixel hashes, size, mode, format."""

    sha256: str  # of the file's bytes
    pixel_sha256: str  # of the decoded pixels (RGB or RGBA) and the size
    dhash: int  # 64-bit difference hash of the grey-level image
    width: int
    height: int
    mode: str  # Pillow mode as stored: RGB, L, RGBA, P, ...
    format: str  # PNG, JPEG, WEBP, BMP, TIFF
    ext: str  # the stored file's extension, e.g. ".png"
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dhash"] = f"{self.dhash:016x}"
        return out


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow comes with the images extra
        raise DataError("image data needs Pillow", hint="pip install 'tunelab[images]'") from exc
    return Image


def open_image(data: bytes, where: str):
    """Decode `data` completely (a truncated file fails here); DataError naming `where`."""
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # structure and checksums, without decoding
        img = Image.open(io.BytesIO(data))
        img.load()  # every pixel: catches a file cut short
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for bad files
        raise DataError(
            f"{where}: not a readable image ({type(exc).__name__}: {exc})",
            hint="replace or remove the file (PNG, JPEG, WebP, BMP and TIFF are read), then run "
            "`tunelab data` again",
        ) from None
    return img


def canonical_pixels(img: Any) -> Any:
    """RGB, or RGBA when the image has transparency: the form exact duplicates compare."""
    has_alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info
    return img.convert("RGBA" if has_alpha else "RGB")


def dhash(img: Any) -> int:
    """64-bit difference hash: a 9x8 grey-level thumbnail, one bit per left<right neighbour."""
    Image = _pil()
    small = np.asarray(canonical_pixels(img).convert("L").resize((9, 8), Image.BILINEAR))
    bits = (small[:, 1:] > small[:, :-1]).flatten()
    return int(sum(1 << i for i, b in enumerate(bits.tolist()) if b))


def image_facts(data: bytes, where: str) -> ImageFacts:
    """Decode `data` and describe it; DataError naming `where` when it cannot be read."""
    img = open_image(data, where)
    pixels = canonical_pixels(img)
    h = hashlib.sha256(f"{pixels.mode}:{pixels.width}x{pixels.height}:".encode())
    h.update(pixels.tobytes())
    fmt = (img.format or "").upper()
    ext = {"JPEG": ".jpg", "TIFF": ".tif"}.get(fmt, "." + fmt.lower() if fmt else ".img")
    return ImageFacts(
        sha256=hashlib.sha256(data).hexdigest(),
        pixel_sha256=h.hexdigest(),
        dhash=dhash(img),
        width=img.width,
        height=img.height,
        mode=img.mode,
        format=fmt,
        ext=ext,
        bytes=len(data),
    )


def stored_name(facts: ImageFacts) -> str:
    """The image's file name inside a snapshot folder."""
    return f"images/{facts.sha256}{facts.ext}"


# ---------------------------------------------------------------- reading


@dataclass
class ImageSource:
    """The image behind each source row (same order as `SourceData.rows`) and its bytes."""

    facts: list[ImageFacts]
    data: dict[str, bytes]  # stored name -> bytes


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS


def read_image_folder(src: SourceData, cfg: DataConfig) -> ImageSource:
    """A folder per label of image files: one row per file, its path as the row's text."""
    root, follow = src.root, cfg.source.follow_links
    if not root.is_dir():
        raise DataError(
            f"{root}: not a folder (format: folder wants one sub-folder of images per label)",
            hint="fix data.source.path, or set data.source.format to the file's format",
        )
    labels = sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and _contained(p, root, follow, src)
    )
    if not labels:
        raise DataError(
            f"{root}: no label folders (format: folder wants {root}/<label>/<image files>)",
            hint="put each category's images in a sub-folder named after the category",
        )
    images = ImageSource([], {})
    for folder in labels:
        files = sorted(p for p in folder.rglob("*") if _is_image(p))
        if not files:
            raise DataError(
                f"{folder}: label folder {folder.name!r} has no image files "
                f"({', '.join(IMAGE_EXTENSIONS)})",
                hint="remove the empty folder, or put the category's images in it",
            )
        for path in files:
            _contained(path, root, follow, src)
            rel = _rel(path, root)
            _add_image(src, images, path, rel)
            src.rows.append(SourceRow(rel, folder.name, None, rel, None, rel, folder.name))
    return images


def attach_images(src: SourceData, cfg: DataConfig) -> ImageSource:
    """Rows read from JSONL / CSV / Parquet whose text is an image path (`data.fields.image`,
    relative to the data file's folder): read each image, the path made relative to it."""
    base = src.root if src.root.is_dir() else src.root.parent
    images = ImageSource([], {})
    for row in src.rows:
        raw = row.text.strip()
        where = f"{row.where} (field {cfg.fields.image!r}, image)"
        if not raw:
            raise DataError(f"{where}: the image path is empty", hint="fill in the file's path")
        path = (base / raw) if not Path(raw).is_absolute() else Path(raw)
        if not path.is_file():
            raise DataError(
                f"{where}: no image file {raw!r} (looked in {base})",
                hint="image paths are relative to the data file's folder; fix the path",
            )
        _contained(path, base, cfg.source.follow_links, src)
        row.text = _rel(path, base)
        _add_image(src, images, path, where)
    return images


def _add_image(src: SourceData, images: ImageSource, path: Path, where: str) -> None:
    data = path.read_bytes()
    _record_file(src, path, data)
    add_image_bytes(images, data, where)


def add_image_bytes(images: ImageSource, data: bytes, where: str) -> None:
    """Decode and describe one image's bytes, and keep them under their stored name."""
    facts = image_facts(data, where)
    images.facts.append(facts)
    images.data[stored_name(facts)] = data


def read_images(src: SourceData, cfg: DataConfig) -> ImageSource:
    """Read the images of an image_classification source (`read_source` read the rows)."""
    if cfg.source.format == "folder":
        return read_image_folder(src, cfg)
    return attach_images(src, cfg)


# ---------------------------------------------------------------- duplicates


def hamming_pairs(hashes: np.ndarray, max_distance: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i < j) whose 64-bit hashes differ in at most `max_distance` bits, and those
    distances. hashes: [n] uint64; compares BLOCK_ROWS rows against all later rows at a time."""
    n = len(hashes)
    found_pairs, found_dist = [], []
    for start in range(0, n, BLOCK_ROWS):
        block = hashes[start : start + BLOCK_ROWS]
        dist = np.bitwise_count(block[:, None] ^ hashes[None, :]).astype(np.int16)  # [b, n]
        rows, cols = np.nonzero(dist <= max_distance)
        i = rows + start
        keep = cols > i
        found_pairs.append(np.stack([i[keep], cols[keep]], axis=1))
        found_dist.append(dist[rows[keep], cols[keep]])
    if not found_pairs:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int16)
    return np.concatenate(found_pairs), np.concatenate(found_dist)


def max_distance_for(threshold: float) -> int:
    """The most differing bits of a near pair: similarity 1 - d/64 >= threshold."""
    return int(np.floor((1.0 - threshold) * HASH_BITS + 1e-9))


def find_image_duplicates(
    facts: list[ImageFacts], *, exact: bool, near: bool, threshold: float
) -> tuple[list[DuplicatePair], dict[str, Any]]:
    """Exact pairs (equal decoded pixels) and near pairs (dHash similarity >= threshold, not
    already exact) among the rows, a < b; and the algorithm's settings for the manifest."""
    pairs: list[DuplicatePair] = []
    groups = exact_group_ids([f.pixel_sha256 for f in facts]) if facts else np.zeros(0, int)
    if exact:
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(groups.tolist()):
            by_group.setdefault(g, []).append(i)
        for members in by_group.values():
            first = members[0]
            pairs += [DuplicatePair(first, x, "exact", 1.0) for x in members[1:]]
    max_d = max_distance_for(threshold)
    if near and len(facts) > 1:
        hashes = np.array([f.dhash for f in facts], dtype=np.uint64)
        idx, dist = hamming_pairs(hashes, max_d)
        for (a, b), d in zip(idx.tolist(), dist.tolist(), strict=True):
            if exact and groups[a] == groups[b]:
                continue
            pairs.append(DuplicatePair(a, b, "near", 1.0 - d / HASH_BITS))
    pairs.sort(key=lambda p: (p.a, p.b))
    info = {
        "image_hash": f"dhash-{HASH_BITS} v{DHASH_VERSION}",
        "exact": "sha256 of the decoded RGB(A) pixels and the size",
        "max_hamming_distance": max_d,
    }
    return pairs, info
