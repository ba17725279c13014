"""A worker module for tests/core/test_worker.py: does what its spec's `do` says."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from tunelab.core.errors import ModelError
from tunelab.core.worker import serve

LONG = "the base changed: " + "x" * 5000


def body(spec: dict[str, Any], out: Path) -> dict[str, Any] | None:
    what = spec["do"]
    if what == "ok":
        (out / "extra.txt").write_text(spec["text"])
        return {"answer": 42}
    if what == "tunelab":
        raise ModelError(LONG, hint="restore the base folder")
    if what == "python":
        raise KeyError("no such key")
    if what == "crash":
        print("dying without a word", file=sys.stderr, flush=True)
        os._exit(3)
    time.sleep(60)
    return None


if __name__ == "__main__":
    sys.exit(serve(body))
