"""inspect, images: per category the sizes and modes, per example the chain step by step."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.rule import Rule
from rich.text import Text

from tunelab.cli.common import console, table


def _spread(d: dict[str, Any]) -> str:
    return f"{d['min']:g}/{d['median']:g}/{d['max']:g}"


def _step_line(s: dict[str, Any]) -> str:
    size = f" -> {s['size'][0]}x{s['size'][1]} {s['mode']}" if "size" in s else ""
    keys = ("step", "size", "mode", "train_only")
    extra = ", ".join(f"{k} {v}" for k, v in s.items() if k not in keys)
    return f"{s['step']}{size}" + (f" ({extra})" if extra else "")


def print_image_record(record: dict[str, Any]) -> None:
    """The terminal view of an image inspect record (the HTML page has the thumbnails)."""
    console.print(
        f"[bold]{escape(str(record['study']))}[/] split {record['split']}, snapshot "
        f"{record['snapshot_id']}, {record['n']} images, chain sha256 "
        f"{record['template_sha256'][:12]}"
    )
    for ex in record["examples"]:
        o, t = ex["original"], ex["tensor"]
        console.print(Rule(Text(f"{ex['id']}  {ex['category']}"), align="left"))
        console.print(
            Text(
                f"original {o['size'][0]}x{o['size'][1]} {o['mode']} {o['format']}"
                + (
                    f" (upright by its EXIF orientation {o['exif_orientation']})"
                    if o.get("exif_orientation")
                    else ""
                )
                + f"; label index {ex['label_index']}",
                style="dim",
            )
        )
        for s in ex["steps"]:
            console.print(Text("  " + _step_line(s)))
        console.print(
            Text(
                f"  tensor {t['shape']} {t['dtype']} range [{t['min']:g}, {t['max']:g}] "
                f"mean {t['mean']:g}"
            )
        )
        if "train_view" in ex:
            steps = " | ".join(_step_line(s) for s in ex["train_view"]["steps"])
            console.print(Text(f"  training view: {steps}", style="dim"))
    rows = [
        [
            name,
            d["n"],
            _spread(d["width"]),
            _spread(d["height"]),
            _spread(d["aspect"]),
            ", ".join(f"{m} {n}" for m, n in d["modes"].items()),
        ]
        for name, d in record["distributions"].items()
    ]
    console.print(
        table(
            "images per category (min/median/max)",
            ["category", "n", "width", "height", "aspect", "modes"],
            rows,
        )
    )
    for w in record["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(Text(f"record: {record['json_path']}\npage:   {record['html_path']}"))
    if record["ok"]:
        console.print(f"[green]all checks pass[/] on {record['n']} images")
