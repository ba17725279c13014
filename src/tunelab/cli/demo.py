"""tunelab demo."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunelab.cli.common import JsonOpt, app, console, emit_json, table
from tunelab.demo.run import DEMO_TASKS, run_demo


@app.command()
def demo(
    task: Annotated[
        str, typer.Option(help=f"Demo study: {' | '.join(DEMO_TASKS)}.")
    ] = "classification",
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Folder for the study (new).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run every stage on a real model and real data (MiniLM + BBC, or SmolLM2 + SpamAssassin)."""
    from datetime import datetime

    folder = directory or Path(f"demo-{task}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    result = run_demo(task, folder, log=console.print)
    if json_out:
        emit_json(result)
        return
    console.print(
        table(
            "demo stages", ["stage", "seconds"], [[t, f"{s:.1f}"] for t, s in result["timings_s"]]
        )
    )
    console.print(f"total {result['total_s']:.0f} s. dossier: [bold]{result['dossier']}[/]")
