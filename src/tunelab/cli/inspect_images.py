"""inspect, images: per category the sizes and modes, per example the chain step by step."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.rule import Rule
from rich.text import Text

from tunelab.cli.common import console, table
from tunelab.core.record_inspect import ImageExample, Inspection


def _spread(d: dict[str, float] | None) -> str:
    d = d or {}
    return f"{d['min']:g}/{d['median']:g}/{d['max']:g}"


def _step_line(s: dict[str, Any]) -> str:
    size = f" -> {s['size'][0]}x{s['size'][1]} {s['mode']}" if "size" in s else ""
    keys = ("step", "size", "mode", "train_only")
    extra = ", ".join(f"{k} {v}" for k, v in s.items() if k not in keys)
    return f"{s['step']}{size}" + (f" ({extra})" if extra else "")


def _print_example(ex: ImageExample) -> None:
    o, t = ex.original, ex.tensor
    console.print(Rule(Text(f"{ex.id}  {ex.category}"), align="left"))
    upright = (
        f" (upright by its EXIF orientation {o.exif_orientation})" if o.exif_orientation else ""
    )
    width, height = o.size[:2] if len(o.size) >= 2 else (None, None)
    console.print(
        Text(
            f"original {width}x{height} {o.mode} {o.format}{upright}; label index {ex.label_index}",
            style="dim",
        )
    )
    for s in ex.steps or []:
        console.print(Text("  " + _step_line(s)))
    console.print(
        Text(f"  tensor {t.shape} {t.dtype} range [{t.min:g}, {t.max:g}] mean {t.mean:g}")
    )
    if ex.train_steps is not None:
        steps = " | ".join(_step_line(s) for s in ex.train_steps)
        console.print(Text(f"  training view: {steps}", style="dim"))


def print_image_record(record: Inspection) -> None:
    """The terminal view of an image inspect record (the HTML page has the thumbnails)."""
    console.print(
        f"[bold]{escape(str(record.study))}[/] split {record.split}, snapshot "
        f"{record.snapshot_id}, {record.n} images, chain sha256 "
        f"{str(record.template_sha256)[:12]}"
    )
    for ex in record.image_examples:
        _print_example(ex)
    rows = [
        [
            name,
            d.n,
            _spread(d.width),
            _spread(d.height),
            _spread(d.aspect),
            ", ".join(f"{m} {n}" for m, n in (d.modes or {}).items()),
        ]
        for name, d in record.distributions.items()
    ]
    console.print(
        table(
            "images per category (min/median/max)",
            ["category", "n", "width", "height", "aspect", "modes"],
            rows,
        )
    )
    for w in record.warnings or []:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(Text(f"record: {record.path}\npage:   {record.html_path}"))
    if record.ok:
        console.print(f"[green]all checks pass[/] on {record.n} images")
