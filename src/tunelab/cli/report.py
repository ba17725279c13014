"""tunelab report."""

from __future__ import annotations

from pathlib import Path

from tunelab.cli.common import JsonOpt, StudyDir, app, console, emit_json, open_study


@app.command()
def report(study: StudyDir = Path("."), json_out: JsonOpt = False) -> None:
    """Build report/dossier.html and report/dossier.md from the study's records."""
    # matplotlib: imported only when a report is built
    from tunelab.stages.report import stage as report_stage

    s = open_study(study, None)
    paths = report_stage.run(s)
    if json_out:
        emit_json({k: str(v) for k, v in paths.items()})
        return
    console.print(f"dossier: [bold]{paths['html']}[/]")
    console.print(f"         {paths['markdown']}")
