"""Shared pieces of the command line: the app, options every command takes, output helpers.

Commands live in `tunelab.cli.<stage>` modules that register on `app` (discovered by
`tunelab.cli.load_commands`). Use `StudyDir`, `SetOpt`, `JsonOpt`, `open_study` (it also
remembers the folder for a crash file: `tunelab.cli._crash`), `emit_json`, `table`, `console`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tunelab.core.study import Study

app = typer.Typer(
    name="tunelab",
    help="Fine-tuning experiments run as a careful protocol, with the evidence kept.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)
console_err = Console(stderr=True, highlight=False, soft_wrap=True)

StudyDir = Annotated[Path, typer.Option("--study", "-s", help="Study folder (holds study.yaml).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config value: --set training.lr=1e-4 (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]


_opened: list[Path] = []  # the study folder this command opened (a crash file goes there)
_sets: list[str] = []  # its --set items (an error about a value they wrote names them)


def open_study(study: Path, sets: list[str] | None) -> Study:
    if (Path(study) / "study.yaml").is_file():
        _opened[:] = [Path(study).resolve()]
    _sets[:] = list(sets or [])
    return Study.open(study, sets or [])


def opened_study(forget: bool = False) -> Path | None:
    """The folder of the study this command opened, or None; `forget`: a new command starts."""
    if forget:
        _opened.clear()
        _sets.clear()
    return _opened[-1] if _opened else None


def opened_overrides() -> list[str]:
    """The `--set` items the study of this command was opened with."""
    return list(_sets)


def rate_unit(study: Study, short: bool = False) -> str:
    """What a training step's throughput counts: images for an image task (its batches count
    images), tokens otherwise."""
    images = study.config.task.kind == "image_classification"
    if short:
        return "img/s" if images else "tok/s"
    return "images/s" if images else "tokens/s"


def emit_json(obj: Any) -> None:
    # print() rather than rich so that the JSON is never wrapped or styled
    print(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def table(title: str | None, columns: list[str], rows: list[list[Any]], **kw: Any) -> Table:
    """A table whose cells wrap, and fold a word wider than its column (a path, an id): at 80
    columns and in a pipe nothing is cut."""
    t = Table(title=title, title_justify="left", **kw)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    return t


def fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)
