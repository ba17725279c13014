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

from rich.markup import escape

from tunelab.cli.common import app, console_err
from tunelab.errors import TunelabError


def _load_commands() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name != "common" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _load_commands()
    try:
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
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(1)
        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        raise
