"""Typed pieces a smoke reads and writes, read the way `core.record_base.Record` reads a record:
each checks its fields and raises the located `StudyError` of a damaged record naming the file,
the place and the field.

| piece           | where                                          | written by                 |
|-----------------|------------------------------------------------|----------------------------|
| `SmokeCheck`    | `checks[i]` of runs/<run>/smoke.json           | stages.smoke.stage         |
| `AdapterTiming` | `adapter_timing` of runs/<run>/smoke.json      | lib.probes                 |
| `UpdateCheck`   | `update_check` of runs/<run>/status.json       | stages.train.callbacks     |

The smoke record itself is `core.record_types.Smoke`, a run's status `RunStatus`, and a line of
its metrics.jsonl `core.run_parts.TrainStep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.core.record_base import Record
from tunelab.core.record_types import RunStatus, Smoke

__all__ = [
    "AdapterTiming",
    "SmokeCheck",
    "UpdateCheck",
    "adapter_timing_of",
    "checks_of",
    "update_check_of",
]


@dataclass(frozen=True)
class SmokeCheck(Record):
    """One check of a smoke: its name, whether it passed (None: it could not be judged) and
    what was found."""

    check: str
    ok: bool | None
    detail: str


@dataclass(frozen=True)
class AdapterTiming(Record):
    """How the unmerged adapter's cost was timed (`lib.probes.adapter_time_ratio`): the unit
    it is per and how many passes on and off."""

    unit: str | None = None  # "decoding step" | "evaluation"
    pairs: int | None = None
    off_s: float | None = None
    on_s: float | None = None
    decode_steps: int | None = None


@dataclass(frozen=True)
class UpdateCheck(Record):
    """The training run's update check: the tensors that moved or stayed against the method
    (`violations`: None when it was not run), the trainable ones no gradient reached."""

    after_step: int | None = None
    violations: list[str] | None = None
    unused: list[str] | None = None  # trainable in name only: the forward never reads them
    unused_parameters: int | None = None
    unrouted_experts: list[Any] | None = None  # expert tensors no token was routed to
    note: str | None = None


def checks_of(smoke: Smoke) -> list[SmokeCheck]:
    return smoke.parts(SmokeCheck, "checks")


def adapter_timing_of(smoke: Smoke) -> AdapterTiming | None:
    """None where the adapter's cost was not timed."""
    found = smoke.adapter_timing
    return None if found is None else AdapterTiming.of(smoke.path, found, "adapter_timing")


def update_check_of(status: RunStatus) -> UpdateCheck:
    """The status's update check (all None where the run recorded none)."""
    return status.part(UpdateCheck, "update_check") or UpdateCheck(
        status.path, {}, where="update_check"
    )
