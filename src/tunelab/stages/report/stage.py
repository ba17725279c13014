"""`tunelab report`: the dossier, built only from the study's records.

report/dossier.md and report/dossier.html (self-contained: images inlined, every string escaped)
plus the plot PNGs. The sections and their order: `tunelab.stages.report.sections`.
"""

from __future__ import annotations

from pathlib import Path

from tunelab.core.ledger import utc_now
from tunelab.core.records import write_bytes_atomic
from tunelab.core.study import Study
from tunelab.stages.report.collect import collect
from tunelab.stages.report.document import render_html, render_markdown
from tunelab.stages.report.sections import build_sections


def run(study: Study) -> dict[str, Path]:
    """Write report/dossier.md, report/dossier.html and the plots; returns their paths."""
    data = collect(study)
    out_dir = study.root / "report"
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    sections = build_sections(study, data, plot_dir)
    title = f"tunelab dossier: {data.study}"
    stamp = f"Built {utc_now()} from the records in {study.records}."
    sections[0].blocks.insert(0, stamp)
    md = render_markdown(title, sections, out_dir)
    page = render_html(title, sections)
    md_path = write_bytes_atomic(out_dir / "dossier.md", md.encode("utf-8"), overwrite=True)
    html_path = write_bytes_atomic(out_dir / "dossier.html", page.encode("utf-8"), overwrite=True)
    return {"markdown": md_path, "html": html_path, "plots": plot_dir}
