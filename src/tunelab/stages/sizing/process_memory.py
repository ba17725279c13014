"""The measuring process's own memory (Linux, glibc): RSS, its high-water mark, the allocator.

glibc serves blocks above its mmap threshold with mmap and returns them to the system when
freed. Its default threshold moves up (to 32 MiB) after the first frees, and freed activations
then stay in the heap: the RSS keeps an earlier peak and grows with fragmentation instead of
following the live tensors. Pinned at `MMAP_THRESHOLD` (the parent sets
`MALLOC_MMAP_THRESHOLD_`, `pin_mmap_threshold` sets it again at run time), the RSS measures what
a step's tensors need. `trim_heap` (`malloc_trim(0)`) returns the free pages of every arena, so
that a heap grown by earlier, unpinned steps holds nothing that a measured step could reuse
without the RSS showing it.

`Watchdog` stops the process as soon as its RSS passes the memory budget, after writing the
verdict where the parent reads the configuration being measured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

from tunelab.core.records import write_json_atomic

MMAP_THRESHOLD = 65536
# glibc's M_TRIM_THRESHOLD default: the heap's top is given back above this much free space
TRIM_THRESHOLD = 128 * 1024
# the thresholds glibc reaches by itself in a long-running process (its dynamic maximum)
RELEASED_MMAP_THRESHOLD = 32 * 2**20
RELEASED_TRIM_THRESHOLD = 64 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def hwm_bytes() -> int | None:
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


def reset_hwm() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    libc = _libc()
    return bool(
        libc is not None
        and libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def release_mmap_threshold() -> bool:
    """Give glibc back thresholds like those it reaches by itself in a long-running process
    (mmap above 32 MiB, trim above 64 MiB). False where there is no glibc `mallopt`."""
    return _mallopt(RELEASED_MMAP_THRESHOLD, RELEASED_TRIM_THRESHOLD)


def pin_mmap_threshold() -> bool:
    """Pin the mmap threshold at `MMAP_THRESHOLD` again (and the trim threshold at glibc's
    default), as the parent's `MALLOC_MMAP_THRESHOLD_` set it at the start."""
    return _mallopt(MMAP_THRESHOLD, TRIM_THRESHOLD)


def trim_heap() -> bool:
    """`malloc_trim(0)`: every arena's free pages back to the system. False without glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class Watchdog(threading.Thread):
    """Watches the RSS while aimed at a configuration (`aim`), not while paused (`pause`): above
    the budget it writes that configuration's does_not_fit verdict and ends the process."""

    def __init__(self, budget: int):
        super().__init__(daemon=True)
        self.budget = budget
        self.watching = threading.Event()
        self.target: tuple[Path, dict[str, Any]] | None = None

    def aim(self, path: Path, base: dict[str, Any]) -> None:
        self.target = (path, base)
        self.watching.set()

    def pause(self) -> None:
        self.watching.clear()

    def run(self) -> None:
        while self.watching.wait():
            rss = rss_bytes()
            if rss is not None and rss > self.budget and self.target and self.watching.is_set():
                path, base = self.target
                verdict = {
                    **base,
                    "status": "does_not_fit",
                    "reason": f"RSS {rss / 2**20:.0f} MiB passed the memory budget "
                    f"{self.budget / 2**20:.0f} MiB",
                    "measured": {"peak_rss": rss},
                }
                write_json_atomic(path, verdict, overwrite=True)
                os._exit(0)
            time.sleep(0.002)
