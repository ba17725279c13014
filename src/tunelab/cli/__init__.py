"""The `tunelab` command line. Thin: parse, open the study, call the library, print a summary.

Each stage's commands live in a module of this package (`tunelab.cli.<stage>`) that registers
them on `app`; they are discovered here so a new stage needs no edit of this file. Only this
package prints and exits: library code raises TunelabError, shown here without a traceback,
exit code 2. Any other exception is a bug: one line says what failed and where, the traceback
goes to a crash file, exit code 1.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Any, NoReturn

import typer
from rich.markup import escape

from tunelab.cli._crash import crash_summary, write_crash_file
from tunelab.cli._help import arrange_commands
from tunelab.cli.common import app, console_err, opened_overrides, opened_study
from tunelab.core.env import requested_device, under_torchrun
from tunelab.core.errors import TunelabError


def load_commands() -> None:
    """Import every `tunelab.cli.<stage>` module so its commands are registered on `app`."""
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name != "common" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    arrange_commands(app)


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except SystemExit as exc:
        _leave_rank(exc.code)
        raise
    _leave_rank(0)


def _leave_rank(code: Any) -> None:
    """A process that torchrun started as a rank leaves with `os._exit` once its command is
    done: at a normal interpreter exit the collective backend's C++ destructors can abort a
    completed rank ("terminate called without an active exception"), failing the run."""
    if not under_torchrun():
        return
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


# The base class of the usage and parameter errors typer raises: its own (typer ships its click)
# or, for typer on click, click's. Both are public names of the package that raises them.
if hasattr(typer, "TyperException"):
    CommandLineError: type[Exception] = typer.TyperException
else:  # pragma: no cover - typer before it shipped its own click
    import click

    CommandLineError = click.ClickException


def _main(argv: list[str] | None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        load_commands()
        opened_study(forget=True)
        from tunelab.cli.models import draw_downloads

        draw_downloads()  # the library downloads; the CLI draws its bar
        requested_device()  # a bad TUNELAB_DEVICE stops every command before it records
        code = app(args=argv, standalone_mode=False)
        # typer returns the code of an Exit it caught, a Ctrl-C's 130 too, instead of raising
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            if code == 130:
                console_err.print("[red]interrupted[/]")
            sys.exit(code)
    except TunelabError as exc:
        # Messages quote user data and library errors ("[/path:553]"): never read them as markup.
        console_err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.hint:
            console_err.print(f"[yellow]hint:[/] {escape(exc.hint)}", highlight=False)
        _name_overrides(exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        console_err.print("[red]interrupted[/]")
        sys.exit(130)
    except SystemExit:
        raise
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # older click turns a Ctrl-C into this
            console_err.print("[red]interrupted[/]")
            sys.exit(130)
        console_err.print("[red]aborted[/]")
        sys.exit(1)
    except CommandLineError as exc:
        _command_line_error(exc)
    except Exception as exc:  # a bug, not a user error: one line here, the traceback in a file
        _crash(exc, argv)


def _name_overrides(exc: TunelabError) -> None:
    """A stage's error about a value that a `--set` of this command wrote (its message or hint
    names the key) says so: that value is fixed on the command line, not in study.yaml."""
    from tunelab.core.config import override_sources

    said = f"{exc.message} {exc.hint or ''}"
    for item in override_sources(said, opened_overrides()):
        if f"--set {item}" not in said:
            console_err.print(
                f"[yellow]note:[/] {escape(item.partition('=')[0].strip())} comes from "
                f"`--set {escape(item)}` on this command line, not from study.yaml",
                highlight=False,
            )


def _command_line_error(exc: Any) -> NoReturn:
    """A usage error (unknown command or option, bad or missing value) or another click error."""
    message = exc.format_message()
    if not message.strip():
        sys.exit(exc.exit_code)  # no arguments: the help was printed
    console_err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    if exc.exit_code == 2:  # a usage error: the command's help lists what it takes
        console_err.print(
            f"[yellow]hint:[/] `{escape(_command_path(getattr(exc, 'ctx', None)))} --help` "
            "lists the commands, arguments and options",
            highlight=False,
        )
    sys.exit(exc.exit_code)


def _crash(exc: BaseException, argv: list[str] | None) -> NoReturn:
    """An unexpected exception: what failed and where on one line, the traceback saved to a
    crash file (under the study folder, else the temp dir) that the next line names; exit 1."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["tunelab", *args[:1]])
    summary = crash_summary(exc)
    try:
        path: str = str(write_crash_file(exc, args, opened_study()))
    except OSError as err:
        path = f"(not saved: {err})"
    console_err.print(f"[bold red]error:[/] {command} failed: {escape(summary)}", highlight=False)
    console_err.print(
        f"[yellow]crash file:[/] {escape(path)} (the traceback; please report it with this file)",
        highlight=False,
    )
    sys.exit(1)


def _command_path(ctx: Any) -> str:
    """`tunelab train` for a usage error in `train`; `tunelab` for one in the group."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["tunelab", *reversed(names)])
