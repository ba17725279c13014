"""A small document model rendered twice: Markdown and self-contained HTML.

Sections hold paragraphs, tables and images; both renderers walk the same structure, so the two
dossiers cannot disagree. The HTML escapes every string (they come from data and configs) and
inlines images as base64.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]
    caption: str | None = None


@dataclass
class Image:
    path: Path
    alt: str


@dataclass
class Section:
    title: str
    blocks: list[str | Table | Image] = field(default_factory=list)

    def text(self, s: str) -> Section:
        self.blocks.append(s)
        return self

    def table(
        self, columns: list[str], rows: list[list[Any]], caption: str | None = None
    ) -> Section:
        self.blocks.append(Table(columns, rows, caption))
        return self

    def image(self, path: Path | None, alt: str) -> Section:
        if path is not None and Path(path).exists():
            self.blocks.append(Image(Path(path), alt))
        return self


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, sections: list[Section], image_base: Path) -> str:
    out = [f"# {title}", ""]
    for sec in sections:
        out += [f"## {sec.title}", ""]
        for b in sec.blocks:
            if isinstance(b, str):
                out += [b, ""]
            elif isinstance(b, Table):
                if b.caption:
                    out += [f"*{b.caption}*", ""]
                out.append("| " + " | ".join(_md_escape(c) for c in b.columns) + " |")
                out.append("|" + "---|" * len(b.columns))
                for r in b.rows:
                    out.append("| " + " | ".join(_md_escape(_cell(v)) for v in r) + " |")
                out.append("")
            elif isinstance(b, Image):
                try:
                    rel = b.path.relative_to(image_base)
                except ValueError:
                    rel = b.path
                out += [f"![{b.alt}]({rel.as_posix()})", ""]
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{border-bottom:2px solid #333}h2{border-bottom:1px solid #ccc;margin-top:2em}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}caption{text-align:left;font-style:italic;padding:.3em 0}
img{max-width:100%;border:1px solid #eee}.pass{color:#070}.fail{color:#b00;font-weight:bold}
p{line-height:1.5}
"""


def _html_cell(v: Any) -> str:
    s = html.escape(_cell(v))
    if s in ("pass", "PASS"):
        return f'<span class="pass">{s}</span>'
    if s in ("fail", "FAIL"):
        return f'<span class="fail">{s}</span>'
    return s


def render_html(title: str, sections: list[Section]) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for i, sec in enumerate(sections):
        out.append(f'<h2 id="s{i}">{html.escape(sec.title)}</h2>')
        for b in sec.blocks:
            if isinstance(b, str):
                out.append(f"<p>{html.escape(b)}</p>")
            elif isinstance(b, Table):
                out.append("<table>")
                if b.caption:
                    out.append(f"<caption>{html.escape(b.caption)}</caption>")
                out.append(
                    "<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in b.columns) + "</tr>"
                )
                for r in b.rows:
                    out.append("<tr>" + "".join(f"<td>{_html_cell(v)}</td>" for v in r) + "</tr>")
                out.append("</table>")
            elif isinstance(b, Image):
                data = base64.b64encode(b.path.read_bytes()).decode("ascii")
                out.append(
                    f'<img alt="{html.escape(b.alt, quote=True)}" src="data:image/png;base64,{data}">'
                )
    out.append("</body></html>")
    return "\n".join(out)
