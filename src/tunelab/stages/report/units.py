"""Figures as the dossier shows them: rounded, with their unit, the exact value kept beside.

Each function returns a `Value`; the HTML shows the exact value on hover, the records hold it
whole.
"""

from __future__ import annotations

from typing import Any

from tunelab.stages.report.document import Value


def size(b: float | None) -> Value | None:
    """Bytes in MiB under 1 GiB, else GiB."""
    if b is None:
        return None
    shown = f"{b / 2**20:,.1f} MiB" if abs(b) < 2**30 else f"{b / 2**30:,.2f} GiB"
    return Value(shown, f"{int(b):,} bytes")


def mib(x: float | None) -> Value | None:
    return None if x is None else Value(f"{x:,.1f} MiB", x)


def seconds(x: float | None) -> Value | None:
    if x is None:
        return None
    return Value(f"{x:,.1f} s" if abs(x) >= 10 else f"{x:.3g} s", x)


def percent(x: float | None, *, signed: bool = False) -> Value | None:
    """A figure already in percent."""
    if x is None:
        return None
    return Value(f"{x:+.1f} %" if signed else f"{x:.1f} %", x)


def share(x: float | None) -> Value | None:
    """A fraction of 1 shown in percent."""
    return None if x is None else Value(f"{100 * x:.1f} %", x)


def p_value(p: float | None) -> Value | None:
    if p is None:
        return None
    return Value("< 0.001" if p < 0.001 else f"{p:.3g}", p)


def by_key(key: str, v: Any) -> Any:
    """A record's field shown by what its name says it holds (`*_bytes`, `*_s`, `*_pct`,
    `tokens_per_s`, `margin`, `calibration`); anything else as it is."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return v
    if key.endswith("_bytes"):
        return size(v)
    if key == "tokens_per_s":
        return Value(f"{v:,.0f} tokens/s", v)
    if key.endswith("_s"):
        return seconds(v)
    if key.endswith("_pct"):
        return percent(v)
    if key == "margin":
        return share(v)
    if key == "calibration":
        return Value(f"x {v:.2f}", v)
    return v
