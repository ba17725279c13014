"""A small document model rendered twice: Markdown and self-contained HTML.

Sections hold paragraphs, tables, images and galleries of thumbnails; both renderers walk the
same structure, so the two dossiers cannot disagree (Markdown lists a gallery's captions). The
HTML escapes every string (they come from data and configs), inlines images as base64, keeps
every table inside the page (a wide one scrolls in its own box) and shows the exact value of a
rounded figure on hover.

A `Section` holds strings, `Table`, `Image` (a PNG file) and `Gallery(thumbs: [Thumb(png bytes,
caption)], caption)`, inlined as data URIs in dossier.html and given by their captions in
dossier.md.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Value:
    """A cell shown as `shown` (rounded, with its unit) whose exact value is `exact`."""

    shown: str
    exact: Any = None


@dataclass
class Table:
    columns: list[str | Value]
    rows: list[list[Any]]
    caption: str | None = None


@dataclass
class Image:
    path: Path
    alt: str


@dataclass
class Thumb:
    """A small picture inlined in the HTML (PNG bytes) with the caption both renderers show."""

    png: bytes
    caption: str


@dataclass
class Gallery:
    thumbs: list[Thumb]
    caption: str | None = None


@dataclass
class Section:
    title: str
    blocks: list[str | Table | Image | Gallery] = field(default_factory=list)

    def text(self, s: str) -> Section:
        self.blocks.append(s)
        return self

    def table(
        self, columns: list[str | Value], rows: list[list[Any]], caption: str | None = None
    ) -> Section:
        self.blocks.append(Table(columns, rows, caption))
        return self

    def gallery(self, thumbs: list[Thumb], caption: str | None = None) -> Section:
        if thumbs:
            self.blocks.append(Gallery(thumbs, caption))
        return self

    def image(self, path: Path | None, alt: str) -> Section:
        if path is not None and Path(path).exists():
            self.blocks.append(Image(Path(path), alt))
        return self


def cell_text(v: Any) -> str:
    """What a cell shows: "-" for nothing, yes/no, floats to 4 decimals, a Value as given."""
    if v is None:
        return "-"
    if isinstance(v, Value):
        return v.shown
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _exact(v: Any) -> str | None:
    """What hovering a cell shows: the exact value, when the cell rounds it."""
    if isinstance(v, Value):
        return None if v.exact is None or str(v.exact) == v.shown else str(v.exact)
    if isinstance(v, float) and float(cell_text(v)) != v:
        return repr(v)
    return None


def anchor(title: str) -> str:
    """The id of a section heading, as GitHub and most Markdown renderers derive it."""
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, sections: list[Section], image_base: Path) -> str:
    out = [f"# {title}", "", "Contents:", ""]
    out += [f"- [{sec.title}](#{anchor(sec.title)})" for sec in sections] + [""]
    for sec in sections:
        out += [f"## {sec.title}", ""]
        for b in sec.blocks:
            if isinstance(b, str):
                out += [b, ""]
            elif isinstance(b, Table):
                if b.caption:
                    out += [f"*{b.caption}*", ""]
                out.append("| " + " | ".join(_md_escape(cell_text(c)) for c in b.columns) + " |")
                out.append("|" + "---|" * len(b.columns))
                for r in b.rows:
                    out.append("| " + " | ".join(_md_escape(cell_text(v)) for v in r) + " |")
                out.append("")
            elif isinstance(b, Image):
                try:
                    rel = b.path.relative_to(image_base)
                except ValueError:
                    rel = b.path
                out += [f"![{b.alt}]({rel.as_posix()})", ""]
            elif isinstance(b, Gallery):
                if b.caption:
                    out += [f"*{b.caption}* (thumbnails in dossier.html)", ""]
                out += [f"- {_md_escape(t.caption)}" for t in b.thumbs] + [""]
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{border-bottom:2px solid #333}h2{border-bottom:1px solid #ccc;margin-top:2em}
nav ol{columns:2;line-height:1.6}
.wide{overflow-x:auto;max-width:100%;margin:1em 0}
td:first-child,th:first-child{white-space:nowrap;max-width:none;position:sticky;left:0;background:#fff}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top;overflow-wrap:break-word;max-width:32em}
th,th:first-child{background:#f3f3f3}caption{text-align:left;font-style:italic;padding:.3em 0}
td[title],th[title]{text-decoration:underline dotted #999;cursor:help}
img{max-width:100%;border:1px solid #eee}.pass{color:#070}.fail{color:#b00;font-weight:bold}
p{line-height:1.5;overflow-wrap:anywhere}
"""


def _attrs(v: Any) -> str:
    exact = _exact(v)
    return "" if exact is None else f' title="{html.escape(exact, quote=True)}"'


def _html_cell(v: Any) -> str:
    s = html.escape(cell_text(v))
    if s in ("pass", "PASS"):
        return f'<span class="pass">{s}</span>'
    if s in ("fail", "FAIL"):
        return f'<span class="fail">{s}</span>'
    return s


def _html_table(b: Table) -> list[str]:
    out = ['<div class="wide"><table>']
    if b.caption:
        out.append(f"<caption>{html.escape(b.caption)}</caption>")
    out.append(
        "<tr>"
        + "".join(f"<th{_attrs(c)}>{html.escape(cell_text(c))}</th>" for c in b.columns)
        + "</tr>"
    )
    for r in b.rows:
        out.append("<tr>" + "".join(f"<td{_attrs(v)}>{_html_cell(v)}</td>" for v in r) + "</tr>")
    out.append("</table></div>")
    return out


def _html_gallery(b: Gallery) -> list[str]:
    out = ['<figure style="margin:1em 0">']
    if b.caption:
        out.append(f"<figcaption><i>{html.escape(b.caption)}</i></figcaption>")
    out.append('<div style="display:flex;flex-wrap:wrap;gap:.8em;margin-top:.4em">')
    for t in b.thumbs:
        data = base64.b64encode(t.png).decode("ascii")
        caption = html.escape(t.caption, quote=True)
        out.append(
            '<figure style="margin:0;width:8.5em;font-size:.8em">'
            f'<img alt="{caption}" src="data:image/png;base64,{data}" '
            'style="image-rendering:pixelated">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    out.append("</div></figure>")
    return out


def render_html(title: str, sections: list[Section]) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        '<nav aria-label="contents"><ol>',
        *(
            f'<li><a href="#{anchor(sec.title)}">{html.escape(sec.title)}</a></li>'
            for sec in sections
        ),
        "</ol></nav>",
    ]
    for sec in sections:
        out.append(f'<h2 id="{anchor(sec.title)}">{html.escape(sec.title)}</h2>')
        for b in sec.blocks:
            if isinstance(b, str):
                out.append(f"<p>{html.escape(b)}</p>")
            elif isinstance(b, Table):
                out += _html_table(b)
            elif isinstance(b, Gallery):
                out += _html_gallery(b)
            elif isinstance(b, Image):
                data = base64.b64encode(b.path.read_bytes()).decode("ascii")
                out.append(
                    f'<img alt="{html.escape(b.alt, quote=True)}" src="data:image/png;base64,{data}">'
                )
    out.append("</body></html>")
    return "\n".join(out)
