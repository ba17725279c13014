"""One error family for user mistakes: a message saying what was found and a hint saying the fix.

The library raises these; only the CLI prints them (without a traceback) and exits with code 2.

Kinds: `ConfigError`, `StudyError`, `HypothesisError`, `DataError`, `SnapshotError`,
`PreprocessError`, `ModelError`, `RunError`, `CheckpointError`, `EvaluationError`,
`ExportError`, ... A failed check is a kind with `exit_code = 1` (`VerifyFailed`, `SmokeFailed`,
`ExampleMismatch`), raised after its record is written and printed; `raise typer.Exit(n)` does
not serve (the CLI runs the app with standalone_mode=False, which returns the code instead of
exiting). `preview(value, limit=80)` is a bounded repr for messages, cut while it is walked.
"""

from __future__ import annotations


class TunelabError(Exception):
    """A problem the user can fix. `message` says what was found, `hint` what to do next."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class ConfigError(TunelabError):
    """study.yaml (or a --set override) is invalid."""


class StudyError(TunelabError):
    """The study folder is missing, incomplete, or a required stage has not run."""


class HypothesisError(TunelabError):
    """No registered hypothesis, or one that cannot be registered."""


class DataError(TunelabError):
    """Bad input data: names the file, line/row and field."""


class SnapshotError(TunelabError):
    """A data snapshot is missing or its files no longer match their hashes."""


class PreprocessError(TunelabError):
    """A broken loss mask, truncated target, missing EOS or template mismatch."""


class ModelError(TunelabError):
    """The base model cannot be found, loaded, or does not match its recorded identity."""


class RunError(TunelabError):
    """A run is missing, in the wrong state, or cannot be resumed as asked."""


class CheckpointError(TunelabError):
    """A checkpoint is missing, truncated or does not match its run."""


class EvaluationError(TunelabError):
    """Evaluation cannot run as asked (spec mismatch, sealed split, missing predictions)."""


class ExportError(TunelabError):
    """An export is incomplete, edited, or bound to another base model."""


def preview(value: object, limit: int = 80) -> str:
    """A short repr of `value` for a message, never longer than `limit` characters and never
    built from the whole value (a huge or deeply nested input costs only what is shown)."""
    out: list[str] = []
    budget = [limit + 1]

    def put(text: str) -> None:
        if budget[0] > 0:
            out.append(text[: budget[0]])
            budget[0] -= len(text)

    def walk(v: object, depth: int) -> None:
        if budget[0] <= 0:
            return
        if isinstance(v, dict | list | tuple) and depth > 8:
            put("...")
        elif isinstance(v, dict):
            put("{")
            for i, (k, item) in enumerate(v.items()):
                if budget[0] <= 0:
                    break
                put(", " if i else "")
                walk(k, depth + 1)
                put(": ")
                walk(item, depth + 1)
            put("}")
        elif isinstance(v, list | tuple):
            put("[")
            for i, item in enumerate(v):
                if budget[0] <= 0:
                    break
                put(", " if i else "")
                walk(item, depth + 1)
            put("]")
        elif isinstance(v, str):
            put(repr(v[: limit + 2]))
        elif isinstance(v, int) and v.bit_length() > 256:  # repr of a huge int may raise
            put(f"<an integer of {v.bit_length()} bits>")
        else:
            put(repr(v)[: limit + 2])

    walk(value, 0)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."
