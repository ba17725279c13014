"""Thumbnails of an image study's flipped examples, for the comparisons section.

Per compared variant and direction (right -> wrong first, then wrong -> right): up to
PER_CATEGORY images of each gold category, captioned with the example's id, its gold label and
the baseline's and the variant's predictions. Built from records only: the two evaluations'
predictions (each image prediction names its stored image) and the image files of the data
snapshot, each checked against the sha256 in its name before it is shown.

`flipped_galleries(dossier, compare, variant)`: `PER_CATEGORY` per gold category and direction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunelab.core.errors import DataError, StudyError
from tunelab.core.hashing import sha256_bytes
from tunelab.core.record_parts import CompareEntry
from tunelab.core.record_types import Compare
from tunelab.core.run_parts import Prediction
from tunelab.stages.report.document import Gallery, Thumb
from tunelab.stages.report.sections.context import Dossier

PER_CATEGORY = 3
DIRECTIONS = (("regressed", "right -> wrong"), ("improved", "wrong -> right"))


def _predictions(d: Dossier, run_id: str | None, split: str) -> dict[str, Prediction]:
    """The prediction rows of an evaluation run, by example id ({} when absent)."""
    path = d.study.runs_dir / str(run_id) / f"predictions-{split}.jsonl"
    out: dict[str, Prediction] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for number, line in enumerate(lines, 1):
        try:
            row = Prediction.of(path, json.loads(line), f"line {number}")
        except (json.JSONDecodeError, StudyError):
            continue
        out[str(row.id)] = row
    return out


def _snapshot_dir(d: Dossier, eval_run: str, split: str) -> Path | None:
    run = d.runs_by_id.get(eval_run)
    ev = run.evaluations.get(split) if run else None
    sid = ev.data_snapshot if ev else None
    return d.study.records / "data" / sid if sid else None


def _thumbnail(folder: Path, name: Any) -> bytes | None:
    """The stored image `name` (images/<sha256>.<ext>) as a thumbnail; None when it is missing
    or its bytes no longer match the sha256 its name carries."""
    from tunelab.lib.preprocess.decode import open_image
    from tunelab.stages.inspect.images import thumbnail_png

    if not isinstance(name, str) or not name.startswith("images/"):
        return None
    path = folder / name
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if sha256_bytes(data) != Path(name).stem:
        return None
    try:
        return thumbnail_png(open_image(data, name))  # upright, as the model read it
    except DataError:  # a stored file open_image refuses (an animation): no thumbnail
        return None


def flipped_galleries(d: Dossier, cmp: Compare, v: CompareEntry) -> list[Any]:
    """The galleries of variant `v` of comparison `cmp`, and a line for flips without an image;
    [] unless the evaluations are of an image model."""
    split = cmp.split or "validation"
    folder = _snapshot_dir(d, str(v.eval_run), split)
    variant = _predictions(d, v.eval_run, split)
    if folder is None or not any(p.image is not None for p in variant.values()):
        return []
    baseline = _predictions(d, cmp.baseline.eval_run if cmp.baseline else None, split)
    name = v.label
    flipped = {"improved": v.flips.improved, "regressed": v.flips.regressed}
    out: list[Any] = []
    missing = 0
    for key, direction in DIRECTIONS:
        ids = [str(i) for i in flipped[key] or []]
        shown: dict[str, int] = {}
        thumbs = []
        for example_id in ids:
            pred, base = variant.get(example_id), baseline.get(example_id)
            gold = str(pred.gold if pred else None)
            if shown.get(gold, 0) >= PER_CATEGORY:
                continue
            png = _thumbnail(folder, pred.image if pred else None)
            if png is None:
                missing += 1
                continue
            shown[gold] = shown.get(gold, 0) + 1
            caption = (
                f"{example_id}: gold {gold}; baseline {base.prediction if base else None}, "
                f"variant {pred.prediction if pred else None}"
            )
            thumbs.append((gold, Thumb(png, caption)))
        if thumbs:
            caption = (
                f"{name}: {direction} on {split} ({len(ids)} in all; up to {PER_CATEGORY} per "
                "gold category)"
            )
            by_category = sorted(thumbs, key=lambda t: t[0])  # stable: flip order within one
            out.append(Gallery([t for _, t in by_category], caption))
    if missing:
        out.append(
            f"{name}: {missing} flipped image(s) not shown (missing from the data snapshot, or "
            "no longer matching the sha256 in its name)."
        )
    return out
