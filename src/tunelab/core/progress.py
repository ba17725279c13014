"""The one progress protocol: a long stage tells its caller `progress(what, done, total, text)`.

- `what`: the bar it moves ("train", "evaluate validation", "minhash", "size", ...); a stage
  may move several.
- `done` of `total`: in the unit of that bar (steps, examples, rows, configurations), or a
  fraction with `total` 1.0; `total` None while it is not known (rows of a file being read).
- `text`: a few words shown beside the bar (the loss and rate, the configuration measured).

Stages call it and never draw: the CLI passes its board's `update`, whose signature this is.
`silent` is the callback of a caller that wants none.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Progress", "silent"]


class Progress(Protocol):
    def __call__(
        self, what: str, done: float, total: float | None = None, text: str = ""
    ) -> None: ...


def silent(what: str, done: float, total: float | None = None, text: str = "") -> None:
    """A progress callback that reports nowhere."""
