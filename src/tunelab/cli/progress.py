"""Progress bars of the commands, driven by the library's progress callbacks.

On a terminal a rich bar per task (description, bar, done/total, the task's text, elapsed,
ETA) on stderr. In a pipe or a log file rich would print nothing until the end, so there a
plain line per task goes to stderr at the first update, then at most every `every_s` seconds,
and once more with the final figures when the command ends:

    train 12/100 (12%) loss 6.2013 | 2,140 tok/s | 0:00:34

`ProgressBoard.update(name, done, total, text)` is the library's progress callback
(core.progress) as it is; `board.prefixed("smoke")` names the bars of a stage run inside another.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from tunelab.core.progress import Progress

PLAIN_EVERY_S = 10.0


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _amount(done: float, total: float | None) -> str:
    """`12/100 (12%)`, `45%` for a fraction (total 1), `1,234` of an unknown total."""
    if not total:
        return f"{done:,g}"
    share = f"{min(1.0, done / total):.0%}"
    return share if total == 1 else f"{done:,g}/{total:,g} ({share})"


class _PlainTask:
    def __init__(self, name: str):
        self.name = name
        self.started = time.perf_counter()
        self.printed_at: float | None = None
        self.done: float = 0
        self.total: float | None = None
        self.text = ""

    def line(self) -> str:
        text = f" {self.text}" if self.text else ""
        elapsed = _clock(time.perf_counter() - self.started)
        return f"{self.name} {_amount(self.done, self.total)}{text} | {elapsed}"


class ProgressBoard:
    """`with ProgressBoard() as board: board.update("train", 3, 8, text="loss 6.2")`.

    `enabled=False` draws nothing (e.g. under --json).
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        stream: IO[str] | None = None,
        every_s: float = PLAIN_EVERY_S,
        transient: bool = False,
    ):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.transient = transient
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._rich: Any = None
        self._rich_tasks: dict[str, Any] = {}
        self._plain: dict[str, _PlainTask] = {}

    def __enter__(self) -> ProgressBoard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, name: str, done: float, total: float | None = None, text: str = "") -> None:
        """Task `name` has `done` of `total` (None: unknown) units; `text` follows the figures."""
        if not self.enabled:
            return
        if self.tty:
            self._update_rich(name, done, total, text)
            return
        task = self._plain.setdefault(name, _PlainTask(name))
        task.done, task.total, task.text = done, total, text
        now = time.perf_counter()
        if task.printed_at is None or now - task.printed_at >= self.every_s:
            self._print(task)

    def prefixed(self, prefix: str) -> Progress:
        """A progress callback whose bars are named "`prefix` what" ("smoke train")."""

        def update(what: str, done: float, total: float | None = None, text: str = "") -> None:
            self.update(f"{prefix} {what}", done, total, text)

        return update

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        for task in self._plain.values():
            self._print(task)
        self._plain.clear()

    def _print(self, task: _PlainTask) -> None:
        task.printed_at = time.perf_counter()
        self.stream.write(task.line() + "\n")
        self.stream.flush()

    def _update_rich(self, name: str, done: float, total: float | None, text: str) -> None:
        if self._rich is None:
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("[bold]{task.description}[/]"),
                BarColumn(),
                TextColumn("{task.fields[amount]}"),
                TextColumn("{task.fields[text]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream, highlight=False),
                transient=self.transient,
            )
            self._rich.start()
        fields = {"amount": _amount(done, total), "text": text}
        if name not in self._rich_tasks:
            self._rich_tasks[name] = self._rich.add_task(name, total=total, **fields)
        self._rich.update(self._rich_tasks[name], completed=done, total=total, **fields)
