"""The `tunelab` command line. Thin: parse, open the study, call the library, print a summary.

Each stage's commands live in a module of this package (`tunelab.cli.<stage>`) that registers
them on `app`; they are discovered here so a new stage needs no edit of this file. Only this
package prints and exits: library code raises TunelabError, shown here without a traceback,
exit code 2.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from types import ModuleType
from typing import Any

from rich.markup import escape

from tunelab.cli.common import app, console_err
from tunelab.env import requested_device, under_torchrun
from tunelab.errors import TunelabError


def load_commands() -> None:
    """Import every `tunelab.cli.<stage>` module so its commands are registered on `app`."""
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name != "common" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except SystemExit as exc:
        _leave_rank(exc.code)
        raise
    _leave_rank(0)


def _leave_rank(code: Any) -> None:
    """A process that torchrun started as a rank leaves with `os._exit` once its command is done
    (records written, process group destroyed, output flushed).

    At a normal interpreter exit, C++ destructors of the collective backend's threads can run
    while a thread is still joinable. Rank 1 of a completed FSDP run then died with "terminate
    called without an active exception" (SIGABRT), and torchrun reported the run as failed. With
    two nodes, node 1's torchrun stopped on that failure without reaching its exit barrier, and
    node 0's waited for it. Seen in 3 of this project's CI runs, never by hand."""
    if not under_torchrun():
        return
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _main(argv: list[str] | None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_commands()
    from tunelab.cli.models import draw_downloads

    draw_downloads()  # the library downloads; the CLI draws its bar
    try:
        requested_device()  # a bad TUNELAB_DEVICE stops every command before it records
        app(args=argv, standalone_mode=False)
    except TunelabError as exc:
        # Messages quote user data and library errors ("[/path:553]"): never read them as markup.
        console_err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.hint:
            console_err.print(f"[yellow]hint:[/] {escape(exc.hint)}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        console_err.print("[red]interrupted[/]")
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as exc:  # click usage errors and aborts carry their own exit codes
        click = _click_exceptions()
        if isinstance(exc, click.UsageError) and not exc.format_message().strip():
            sys.exit(exc.exit_code)  # no arguments: the help was printed
        if isinstance(exc, click.UsageError):  # unknown command or option, bad or missing value
            console_err.print(
                f"[bold red]error:[/] {escape(exc.format_message())}", highlight=False
            )
            console_err.print(
                f"[yellow]hint:[/] `{escape(_command_path(exc.ctx))} --help` lists the "
                "commands, arguments and options",
                highlight=False,
            )
            sys.exit(exc.exit_code)
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.Abort):
            sys.exit(1)
        if isinstance(exc, click.Exit):
            sys.exit(exc.exit_code)
        raise


def _click_exceptions() -> ModuleType:
    """The click that typer runs on: its own vendored copy in recent typer, else click."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def _command_path(ctx: Any) -> str:
    """`tunelab train` for a usage error in `train`; `tunelab` for one in the group."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["tunelab", *reversed(names)])
