"""Image data: reading image files, their facts (size, mode, format), content hashes and
duplicates.

An image example is the usual example dict plus `image` (the file's name inside the snapshot,
`images/<sha256>.<ext>`, where its original bytes are stored) and `image_sha256`; its `text` is
the file's path inside the source, for people to read. Sources: a folder per label (PNG, JPEG,
WebP, BMP, TIFF, GIF), or JSONL / CSV / Parquet with a column of paths (`data.fields.image`,
relative to the data file's folder). Every file is decoded in full when read, so an unreadable,
truncated, animated or 16-bit file is named before anything is written (all of them at once).
A label folder's hidden entries, system files and files of other extensions are skipped, and a
note lists them. A JPEG's EXIF orientation is applied (the picture is read upright, as
transformers' `load_image` and `datasets`' Image read it).

What the model reads is `model_rgb(image)`: transformers' `convert_to_rgb`, transparency
composited onto white. Duplicates compare that: exact when those pixels are equal (a PNG
re-saved as BMP or WebP-lossless counts), near when the 64-bit difference hashes (dHash) of two
images differ in few bits: similarity = 1 - Hamming distance / 64, compared with
`data.dedup.threshold`.

- `image_facts(bytes, where) -> ImageFacts(sha256, pixel_sha256, dhash, width, height, mode,
  format, ext, bytes, orientation)` (refuses a mode outside `ACCEPTED_MODES`);
  Decoding (`open_image`, `decode_image`, `model_rgb`, `ACCEPTED_MODES`) is
  `tunelab.lib.preprocess.decode`'s: the training chain decodes exactly as the snapshot did.
- `add_image_bytes(images, data, where)`: a bad file joins `images.problems`; `finish(src,
  images)` raises every problem in one DataError and adds the notes of skipped and turned files.
- `find_image_duplicates(facts, exact=, near=, threshold=)` gives pairs as
  `tunelab.stages.data.dedup.DuplicatePair`; `hamming_pairs`, `stored_name(facts)`.
- The snapshot also holds `images/` and `images.jsonl` (train and validation facts);
  `load_snapshot` lists files recursively.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tunelab.core.config_sections import DataConfig
from tunelab.core.errors import DataError
from tunelab.core.hashing import sha256_bytes
from tunelab.lib.preprocess.decode import _REPLACE, ACCEPTED_MODES, _pil, decode_image, model_rgb
from tunelab.stages.data.dedup import DuplicatePair, exact_group_ids
from tunelab.stages.data.leftovers import leftover_file, leftover_folder
from tunelab.stages.data.source_files import (
    SourceData,
    SourceRow,
    contained_path,
    record_file,
    relative_name,
)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
# files an operating system leaves in folders of pictures
SYSTEM_FILES = frozenset({"thumbs.db", "ehthumbs.db", "desktop.ini", "icon\r"})
HASH_BITS = 64
DHASH_VERSION = 2
NOTE_NAMES = 8  # file names a note lists before "(+N more)"
_AGAIN = "then run `tunelab data` again"
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
    format: str  # PNG, JPEG, WEBP, BMP, TIFF, GIF
    ext: str  # the stored file's extension, e.g. ".png"
    bytes: int
    orientation: int = 1  # EXIF orientation applied when read (1: none); width x height upright

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dhash"] = f"{self.dhash:016x}"
        return out


def dhash(img: Any) -> int:
    """64-bit difference hash: a 9x8 grey-level thumbnail, one bit per left<right neighbour."""
    Image = _pil()
    small = np.asarray(model_rgb(img).convert("L").resize((9, 8), Image.BILINEAR))
    bits = (small[:, 1:] > small[:, :-1]).flatten()
    return int(sum(1 << i for i, b in enumerate(bits.tolist()) if b))


def image_facts(data: bytes, where: str) -> ImageFacts:
    """Decode `data` and describe it; DataError naming `where` when it cannot be read, or when
    its mode does not convert to RGB faithfully (16-bit or float)."""
    img, orientation = decode_image(data, where)
    if img.mode not in ACCEPTED_MODES:
        raise DataError(
            f"{where}: mode {img.mode!r} ({img.format}) does not convert to 8-bit RGB "
            "faithfully: transformers' conversion would clip its values",
            hint="save it with 8 bits per channel, e.g. for 16-bit grey "
            "`Image.fromarray((np.asarray(im) >> 8).astype('uint8')).save(path)`",
        )
    pixels = model_rgb(img)
    pixel_sha256 = sha256_bytes(
        f"{pixels.mode}:{pixels.width}x{pixels.height}:".encode(), pixels.tobytes()
    )
    fmt = (img.format or "").upper()
    ext = {"JPEG": ".jpg", "TIFF": ".tif"}.get(fmt, "." + fmt.lower() if fmt else ".img")
    return ImageFacts(
        sha256=sha256_bytes(data),
        pixel_sha256=pixel_sha256,
        dhash=dhash(img),
        width=img.width,
        height=img.height,
        mode=img.mode,
        format=fmt,
        ext=ext,
        bytes=len(data),
        orientation=orientation,
    )


def stored_name(facts: ImageFacts) -> str:
    """The image's file name inside a snapshot folder."""
    return f"images/{facts.sha256}{facts.ext}"


# ---------------------------------------------------------------- reading


@dataclass
class ImageSource:
    """The image behind each source row (same order as `SourceData.rows`) and its bytes, with
    what reading found: the files it refused, skipped and turned upright."""

    facts: list[ImageFacts]
    data: dict[str, bytes]  # stored name -> bytes
    problems: list[DataError] = field(default_factory=list)  # raised together by `finish`
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    oriented: list[tuple[str, int]] = field(default_factory=list)  # (where, EXIF orientation)


def _skip_reason(name: str) -> str | None:
    """Why a file of a label folder is not read as an image, or None when it is."""
    if name.startswith("."):
        return "hidden"
    if name.lower() in SYSTEM_FILES:
        return "system file"
    if why := leftover_file(name):
        return why
    suffix = Path(name).suffix.lower()
    if suffix not in IMAGE_EXTENSIONS:
        return f"extension {suffix or '(none)'}"
    return None


def _label_files(
    folder: Path, root: Path, skipped: list[tuple[str, str]], follow: bool
) -> list[Path]:
    """The image files under a label folder and its sub-folders; hidden folders, links to
    folders (unless `follow`: each read once) and other files go to `skipped`."""
    files, seen = [], set()
    for here, dirs, names in os.walk(folder, followlinks=follow):
        real = os.path.realpath(here)
        if real in seen:  # a link back to a folder already read
            dirs[:] = []
            continue
        seen.add(real)
        at = Path(here)
        kept = []
        for d in sorted(dirs):
            if d.startswith("."):
                skipped.append((relative_name(at / d, root) + "/", "hidden"))
            elif not follow and (at / d).is_symlink():
                skipped.append(
                    (relative_name(at / d, root) + "/", "a link to a folder; follow_links reads it")
                )
            else:
                kept.append(d)
        dirs[:] = kept
        for name in sorted(names):
            why = _skip_reason(name)
            if why:
                skipped.append((relative_name(at / name, root), why))
            else:
                files.append(at / name)
    return sorted(files)


def _label_folders(root: Path, follow: bool, src: SourceData, images: ImageSource) -> list[Path]:
    labels = []
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            images.skipped.append((p.name, "not in a label folder"))
        elif p.name.startswith("."):
            images.skipped.append((p.name + "/", "hidden"))
        elif why := leftover_folder(p.name):
            images.skipped.append((p.name + "/", why))
        elif contained_path(p, root, follow, src):
            labels.append(p)
    return labels


def read_image_folder(src: SourceData, cfg: DataConfig) -> ImageSource:
    """A folder per label of image files: one row per file, its path as the row's text."""
    root, follow = src.root, cfg.source.follow_links
    if not root.is_dir():
        raise DataError(
            f"{root}: not a folder (format: folder wants one sub-folder of images per label)",
            hint="fix data.source.path, or set data.source.format to the file's format",
        )
    images = ImageSource([], {})
    labels = _label_folders(root, follow, src, images)
    if not labels:
        raise DataError(
            f"{root}: no label folders (format: folder wants {root}/<label>/<image files>)",
            hint="put each category's images in a sub-folder named after the category",
        )
    for folder in labels:
        files = _label_files(folder, root, images.skipped, follow)
        if not files:
            raise DataError(
                f"{folder}: label folder {folder.name!r} has no image files "
                f"({', '.join(IMAGE_EXTENSIONS)})",
                hint="remove the empty folder, or put the category's images in it",
            )
        for path in files:
            contained_path(path, root, follow, src)
            rel = relative_name(path, root)
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
        contained_path(path, base, cfg.source.follow_links, src)
        row.text = relative_name(path, base)
        _add_image(src, images, path, f"{row.where} (field {cfg.fields.image!r}: {raw})")
    return images


def _add_image(src: SourceData, images: ImageSource, path: Path, where: str) -> None:
    try:
        data = path.read_bytes()
    except OSError as exc:  # a broken link, no permission
        _refuse(images, DataError(f"{where}: cannot be read ({exc.strerror})", hint=_REPLACE))
        return
    record_file(src, path, data)
    add_image_bytes(images, data, where)


def _refuse(images: ImageSource, problem: DataError) -> None:
    images.problems.append(problem)
    images.facts.append(ImageFacts("", "", 0, 0, 0, "", "", "", 0))  # keeps the rows' order


def add_image_bytes(images: ImageSource, data: bytes, where: str) -> None:
    """Decode and describe one image's bytes, and keep them under their stored name; a file
    that cannot be used joins `images.problems` (`finish` raises them together)."""
    try:
        facts = image_facts(data, where)
    except DataError as exc:
        _refuse(images, exc)
        return
    images.facts.append(facts)
    images.data[stored_name(facts)] = data
    if facts.orientation != 1:
        images.oriented.append((where, facts.orientation))


def _listed(items: list[str]) -> str:
    more = f" (+{len(items) - NOTE_NAMES} more)" if len(items) > NOTE_NAMES else ""
    return ", ".join(items[:NOTE_NAMES]) + more


def finish(src: SourceData, images: ImageSource) -> ImageSource:
    """Raise every unusable file at once (DataError, each named with its fix); else add the
    notes of what reading skipped and turned upright to `src.notes`."""
    if len(images.problems) == 1:
        p = images.problems[0]
        raise DataError(p.message, hint=f"{p.hint or _REPLACE}, {_AGAIN}")
    if images.problems:
        raise DataError(
            f"{len(images.problems)} image files cannot be used:\n"
            + "\n".join(f"  - {p.message}\n    fix: {p.hint}" for p in images.problems),
            hint=f"fix or remove each file listed, {_AGAIN}",
        )
    if images.skipped:
        src.notes.append(
            f"skipped {len(images.skipped)} entr{'y' if len(images.skipped) == 1 else 'ies'} "
            "that are not images of a label folder: "
            + _listed([f"{path} ({why})" for path, why in images.skipped])
        )
    if images.oriented:
        src.notes.append(
            f"{len(images.oriented)} image(s) carry an EXIF orientation and are read upright "
            "(as transformers' load_image and datasets' Image read them): "
            + _listed([f"{where} (orientation {o})" for where, o in images.oriented])
        )
    return images


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
        "exact": "sha256 of the RGB pixels the model reads (transparency on white) and the size",
        "max_hamming_distance": max_d,
    }
    return pairs, info
