"""`tunelab inspect` for images: examples of every category through the exact transform chain.

For N examples of each category the record holds the original size, mode, format and bytes, the
chain step by step (size and mode after each step, with the step's settings), and the tensor
that reaches the model (shape, dtype, value range); for the train split also the augmented
training view when augmentation is configured. Over the whole split, per category: the
distribution of sizes, aspect ratios, modes and formats.

Stop conditions (problems): an image that cannot be read, a mode the chain cannot convert
faithfully, non-finite pixel values, an evaluation chain that is not deterministic or holds a
training-only step. Warnings: a category whose images differ systematically in size or mode
from the others (the model can learn the size instead of the content).

The HTML page shows thumbnails before and after the transforms (the tensor mapped back to
pixels through the mean and std).

`inspect_images(pre, rows, split=, per_category=, progress=)` -> the record body (`kind:
"image"`, `distributions`, `warnings`, `examples` with `original`, `steps`, `tensor`,
`thumbnails`, `train_view`); `render_images_html(record)` (the record read as `Inspection`); `thumbnail_png(img, px)` (the dossier's
galleries use it too). `tunelab.stages.inspect.stage.run` dispatches on the
architecture; `tunelab.cli.inspect_images.print_image_record` prints it.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tunelab.core.errors import DataError, PreprocessError
from tunelab.core.progress import Progress
from tunelab.core.record_inspect import ChainStep, ImageExample, ImageSpread, Inspection
from tunelab.lib.preprocess.decode import ACCEPTED_MODES, ORIENTED, model_rgb
from tunelab.lib.preprocess.images import (
    apply_chain,
    example_rng,
    input_size_problem,
    open_example_image,
)
from tunelab.lib.preprocess.problems import Problem

THUMB_PX = 96
# a category whose median area is this many times the others' (or below 1 / it) is flagged
AREA_RATIO_WARN = 1.5
# a mode that covers this share of one category and less than MODE_OTHERS_MAX of the others
MODE_SHARE_WARN = 0.8
MODE_OTHERS_MAX = 0.2


# ---------------------------------------------------------------- pure logic


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


class ImageFacts(NamedTuple):
    """What the split's statistics need of one image as opened."""

    label: str
    width: int
    height: int
    mode: str
    format: str


def distributions(facts: Sequence[ImageFacts]) -> dict[str, dict[str, Any]]:
    """Per category (and "all"): n, width, height, aspect ratio (w / h) spreads, mode and
    format counts."""
    groups: dict[str, list[ImageFacts]] = {"all": list(facts)}
    for f in facts:
        groups.setdefault(f.label, []).append(f)
    out = {}
    for name in ["all", *sorted(k for k in groups if k != "all")]:
        g = groups[name]
        if not g:
            continue
        out[name] = {
            "n": len(g),
            "width": _spread([f.width for f in g]),
            "height": _spread([f.height for f in g]),
            "aspect": _spread([f.width / f.height for f in g]),
            "modes": dict(Counter(f.mode for f in g).most_common()),
            "formats": dict(Counter(f.format for f in g).most_common()),
        }
    return out


def systematic_differences(facts: Sequence[ImageFacts]) -> list[str]:
    """Warnings for categories whose sizes or modes set them apart from the other categories."""
    by_label: dict[str, list[ImageFacts]] = {}
    for f in facts:
        by_label.setdefault(f.label, []).append(f)
    if len(by_label) < 2:
        return []
    out = []
    for label, own in sorted(by_label.items()):
        others = [f for k, g in by_label.items() if k != label for f in g]
        own_area = statistics.median(f.width * f.height for f in own)
        other_area = statistics.median(f.width * f.height for f in others)
        ratio = own_area / other_area if other_area else float("inf")
        if ratio >= AREA_RATIO_WARN or ratio <= 1 / AREA_RATIO_WARN:
            out.append(
                f"category {label!r}: median image area {own_area:g} px against {other_area:g} "
                f"px for the other categories (x{ratio:.2f}): the model can learn the size "
                "instead of the content; resize the sources alike or check how they were made"
            )
        mode, count = Counter(f.mode for f in own).most_common(1)[0]
        share_others = sum(1 for f in others if f.mode == mode) / len(others)
        if count / len(own) >= MODE_SHARE_WARN and share_others < MODE_OTHERS_MAX:
            out.append(
                f"category {label!r}: {count} of {len(own)} images are mode {mode}, against "
                f"{share_others:.0%} of the other categories: the model can learn the mode "
                "(e.g. grey against colour) instead of the content"
            )
    return out


def tensor_summary(pixels: Any) -> dict[str, Any]:
    """Shape, dtype and value range of a [3, H, W] tensor or array."""
    arr = np.asarray(pixels)
    return {
        "shape": list(arr.shape),
        "dtype": str(arr.dtype),
        "min": round(float(arr.min()), 4),
        "max": round(float(arr.max()), 4),
        "mean": round(float(arr.mean()), 4),
    }


def to_display(pixels: Any, chain: Any) -> np.ndarray:
    """The tensor mapped back to 8-bit pixels [H, W, 3] through the chain's mean and std."""
    arr = np.asarray(pixels, dtype=np.float32).transpose(1, 2, 0)
    arr = arr * np.array(chain.std, np.float32) + np.array(chain.mean, np.float32)
    return np.clip(arr / chain.rescale, 0, 255).round().astype(np.uint8)


# ---------------------------------------------------------------- examples


def _problem(example_id: Any, kind: str, message: str, fix: str) -> dict[str, str]:
    return Problem(str(example_id), kind, message, fix).to_dict()


def _open(row: dict[str, Any]) -> tuple[Any, dict[str, str] | None]:
    try:
        return open_example_image(row), None
    except (DataError, OSError) as exc:
        msg = exc.message if isinstance(exc, DataError) else str(exc)
        return None, _problem(
            row["id"],
            "unreadable_image",
            msg,
            "replace the file in the data source, then `tunelab data`",
        )


def thumbnail_png(img: Any, px: int = THUMB_PX) -> bytes:
    """`img` as RGB PNG bytes (converted as the model reads it: transparency on white), its
    longer side scaled to `px` (nearest neighbour: small images stay sharp)."""
    from PIL import Image

    scale = px / max(img.width, img.height)
    size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    buf = io.BytesIO()
    model_rgb(img).resize(size, Image.NEAREST).save(buf, format="PNG")
    return buf.getvalue()


def _thumb(img: Any) -> str:
    """A PNG data URI of `img`, scaled to THUMB_PX."""
    return "data:image/png;base64," + base64.b64encode(thumbnail_png(img)).decode("ascii")


def describe_image(pre: Any, row: dict[str, Any], img: Any, train: bool) -> dict[str, Any]:
    """One example: original facts, each step (settings, size and mode after it), the tensor,
    its thumbnails; a training view when `train` and augmentation is configured."""
    chain = pre.chain
    trace: list[dict[str, Any]] = []
    pixels = apply_chain(img, chain, None, trace)
    settings = {s["step"]: s for s in chain.steps(train=False)}
    steps = [{**settings.get(t["step"], {}), **t} for t in trace]
    steps += [s for s in chain.steps(train=False) if s["step"] in ("rescale", "normalize")]
    from PIL import Image

    out: dict[str, Any] = {
        "id": row["id"],
        "category": str(row.get("label")),
        "source": row.get("text"),
        "label_index": pre.task.label_to_index.get(str(row.get("label")), -1),
        "original": {
            "size": [img.width, img.height],
            "mode": img.mode,
            "format": img.format,
            **({"exif_orientation": img.info[ORIENTED]} if ORIENTED in img.info else {}),
        },
        "steps": steps,
        "tensor": tensor_summary(pixels),
        "thumbnails": {
            "before": _thumb(img),
            "after": _thumb(Image.fromarray(to_display(pixels, chain))),
        },
    }
    augments = chain.train_random_crop or chain.train_flip
    if train and augments:
        view_trace: list[dict[str, Any]] = []
        view = apply_chain(img, chain, example_rng(pre.seed, str(row["id"])), view_trace)
        out["train_view"] = {
            "steps": view_trace,
            "tensor": tensor_summary(view),
            "thumbnail": _thumb(Image.fromarray(to_display(view, chain))),
        }
    return out


def _evaluation_problems(pre: Any, rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The evaluation chain must hold no training-only step and give the same tensor twice."""
    out = []
    train_only = [s["step"] for s in pre.chain.steps(train=False) if s.get("train_only")]
    if train_only:
        out.append(
            _problem(
                "-",
                "augmentation_at_evaluation",
                f"the evaluation chain holds training-only steps {train_only}",
                "augmentation belongs in preprocess.image.train_* only",
            )
        )
    for row in rows:
        a, b = pre.encode(row)["pixel_values"], pre.encode(row)["pixel_values"]
        if not bool((a == b).all()):
            out.append(
                _problem(
                    row["id"],
                    "augmentation_at_evaluation",
                    "two evaluation encodings of the example differ",
                    "evaluation must use the deterministic chain (Preprocessor.encode)",
                )
            )
    return out


def _size_problems(pre: Any, rows: list[dict[str, Any]], model_dir: Any) -> list[dict[str, str]]:
    """One transformed example through the model's own input check (both sizes named)."""
    if model_dir is None or not rows:
        return []
    pixels = pre.encode(rows[0])["pixel_values"]  # [3, H, W]
    size = (int(pixels.shape[1]), int(pixels.shape[2]))
    why = input_size_problem(pre.chain, pre.cfg.image, model_dir, size)
    if why is None:
        return []
    message, fix = why
    return [_problem(rows[0]["id"], "image_size", message, fix)]


def inspect_images(
    pre: Any,
    rows: list[dict[str, Any]],
    *,
    split: str,
    per_category: int,
    progress: Progress | None = None,
    model_dir: Any = None,
) -> dict[str, Any]:
    """The body of an image inspect record for the rows of one split; with `model_dir`, the
    first shown example's pixel values also go through that model's input check."""
    problems: list[dict[str, str]] = []
    facts, shown_rows = [], []
    picked: Counter[str] = Counter()
    examples = []
    for i, row in enumerate(rows):
        img, problem = _open(row)
        if progress:
            progress(f"encoding {split}", i + 1, len(rows))
        if problem:
            problems.append(problem)
            continue
        facts.append(
            ImageFacts(str(row.get("label")), img.width, img.height, img.mode, img.format or "")
        )
        if img.mode not in ACCEPTED_MODES:
            problems.append(
                _problem(
                    row["id"],
                    "unsupported_mode",
                    f"{row.get('text')}: mode {img.mode!r} does not convert to RGB faithfully",
                    f"convert the file to one of {', '.join(ACCEPTED_MODES)}, then `tunelab data`",
                )
            )
            continue
        category = str(row.get("label"))
        if picked[category] < per_category:
            picked[category] += 1
            shown_rows.append(row)
            examples.append(describe_image(pre, row, img, train=split == "train"))
    examples.sort(key=lambda e: e["category"])
    try:
        problems += _evaluation_problems(pre, shown_rows)
        problems += _size_problems(pre, shown_rows[:1], model_dir)
    except PreprocessError as exc:
        problems.append(_problem("-", "preprocess_error", exc.message, exc.hint or ""))
    return {
        "kind": "image",
        "task": pre.task.describe(),
        "preprocess": pre.describe(),
        "template_sha256": pre.template_sha256,
        "n": len(rows),
        "distributions": distributions(facts) if facts else {},
        "warnings": systematic_differences(facts) if facts else [],
        "examples": examples,
        "problems": problems,
        "ok": not problems,
    }


# ---------------------------------------------------------------- HTML page

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:2em}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
img{image-rendering:pixelated;border:1px solid #ccc;margin:.3em}
.problem{color:#b00} .warn{color:#a60} .meta{color:#555}
figure{display:inline-block;margin:.3em;text-align:center} figcaption{font-size:.8em;color:#555}
"""


def _steps_text(steps: list[ChainStep]) -> str:
    parts = []
    for s in steps:
        size = f" -> {s.size[0]}x{s.size[1]} {s.mode}" if s.size is not None else ""
        extra = s.settings
        parts.append(f"{s.step}{size}" + (f" {extra}" if extra else ""))
    return " | ".join(parts)


def _spread_cells(name: str, d: ImageSpread) -> list[str]:
    """A category's row of the page's table: n, the spreads, modes and formats."""
    e = html.escape
    return [
        e(name),
        str(d.n),
        *(
            f"{x.min:g} / {x.median:g} / {x.max:g}"
            for x in (d.spread("width"), d.spread("height"), d.spread("aspect"))
        ),
        e(", ".join(f"{m} {n}" for m, n in (d.modes or {}).items())),
        e(", ".join(f"{m} {n}" for m, n in (d.formats or {}).items())),
    ]


def _example_html(ex: ImageExample) -> list[str]:
    """An example's heading, facts and thumbnails before and after (and its training view)."""
    e = html.escape
    o, t, thumbs = ex.original, ex.tensor, ex.thumbnails
    parts = [
        f"<h2>{e(str(ex.id))} <span class='meta'>[{e(ex.category)}, label index "
        f"{ex.label_index}]</span></h2><p class='meta'>original {o.size[0]}x"
        f"{o.size[1]} {e(str(o.mode))} {e(str(o.format))}; "
        f"{e(_steps_text(ex.chain))}; tensor {t.shape} {e(str(t.dtype))} "
        f"[{t.min:g}, {t.max:g}]</p>"
        f"<figure><img src='{thumbs.before}' alt='before'><figcaption>before"
        f"</figcaption></figure><figure><img src='{thumbs.after}' alt='after'>"
        "<figcaption>after (what the model sees)</figcaption></figure>"
    ]
    if ex.train_view is not None:
        parts.append(
            f"<figure><img src='{ex.train_thumbnail}' alt='training view'>"
            "<figcaption>training view (augmented)</figcaption></figure>"
        )
    return parts


def render_images_html(record: Inspection) -> str:
    """A self-contained page: distributions, warnings, stop conditions, and per example the
    thumbnails before and after the transforms; every user string is escaped."""
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>inspect {e(record.inspect_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(str(record.study))}: {e(record.split)} images</h1>",
        f"<p class='meta'>snapshot {e(str(record.snapshot_id))}, {record.n} examples, chain "
        f"sha256 {e(str(record.template_sha256)[:12])}: "
        f"{e(_steps_text(record.preprocess.chain))}</p>",
        "<h2>Per category</h2><table><tr><th>category</th><th>n</th><th>width</th>"
        "<th>height</th><th>aspect w/h</th><th>modes</th><th>formats</th></tr>",
    ]
    for name, d in record.distributions.items():
        cells = _spread_cells(name, d)
        parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    parts.append("</table><p class='meta'>min / median / max</p>")
    for w in record.warnings or []:
        parts.append(f"<p class='warn'>warning: {e(w)}</p>")
    if record.stop_conditions:
        parts.append("<h2>Stop conditions</h2><ul>")
        for p in record.stop_conditions:
            parts.append(
                f"<li class='problem'>example <b>{e(p.example_id)}</b> [{e(p.kind)}]: "
                f"{e(p.message)}<br><span class='meta'>fix: {e(p.fix)}</span></li>"
            )
        parts.append("</ul>")
    for ex in record.image_examples:
        parts += _example_html(ex)
    parts.append("</body></html>\n")
    return "\n".join(parts)
