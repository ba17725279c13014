"""Crash files: the traceback of an unexpected exception, kept for a bug report.

The terminal gets one line (what failed and where); the file gets the command, the versions
and the whole traceback. It goes to `<study>/crashes/` when a study was opened (never under
records/, which only tunelab's stages write), else to the temp dir.
"""

from __future__ import annotations

import os
import platform
import tempfile
import traceback
from datetime import UTC, datetime
from pathlib import Path

CRASH_DIR = "crashes"


def crash_summary(exc: BaseException) -> str:
    """'RecursionError: maximum recursion depth exceeded (at tunelab/stages/data/formats.py:72 in
    read_jsonl)': the innermost frame of tunelab's own code, else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    dispatch = os.path.join("tunelab", "cli", "__init__.py")
    ours = [
        f
        for f in frames
        if f"{os.sep}tunelab{os.sep}" in f.filename and not f.filename.endswith(dispatch)
    ]
    frame = (ours or frames or [None])[-1]
    where = ""
    if frame is not None:
        name = frame.filename
        if f"{os.sep}tunelab{os.sep}" in name:
            name = "tunelab" + name.rsplit(f"{os.sep}tunelab", 1)[1]
        where = f" (at {name}:{frame.lineno} in {frame.name})"
    message = " ".join(str(exc)[:400].split())
    message = message if len(message) <= 200 else message[:197] + "..."
    return f"{type(exc).__name__}" + (f": {message}" if message else "") + where


def write_crash_file(exc: BaseException, args: list[str], study: Path | None) -> Path:
    """Write the crash report and return its path (the study's crashes/ folder, else temp)."""
    from tunelab import __version__

    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    name = f"crash-{stamp}-{os.getpid()}.txt"
    folder = study / CRASH_DIR if study is not None else Path(tempfile.gettempdir())
    text = "".join(
        [
            f"command: tunelab {' '.join(args)}\n",
            f"tunelab {__version__}, Python {platform.python_version()}, {platform.platform()}\n",
            f"time: {stamp} UTC\n\n",
            *traceback.format_exception(exc),
        ]
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(text, encoding="utf-8")
    except OSError:
        if study is None:
            raise
        path = Path(tempfile.gettempdir()) / name  # a study folder we cannot write to
        path.write_text(text, encoding="utf-8")
    return path
