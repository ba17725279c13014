"""How long a sizing takes: the forecast before it starts (from the latest smoke's step time)
and what is left as configurations end (from the first measured step), for the progress line.

A step's time scales with its tokens (images for an image model); each configuration costs
its timed steps plus `CONFIG_OVERHEAD_STEPS`, a shared process `CONFIG_BUILD_S` for each model
built again, a fresh one `PROCESS_START_S`.
"""

from __future__ import annotations

import time
from typing import Any

from tunelab.core.evidence import latest
from tunelab.core.progress import Progress
from tunelab.core.record_sizing import WRITING, SizingConfiguration, SizingMeasured
from tunelab.core.record_types import Smoke
from tunelab.core.study import Study
from tunelab.stages.sizing.recommend import Option

# Timed steps of the study's own configuration, whose step time the planner multiplies by every
# step of every variant: the first steps after the heap is released still run slower, so it
# gets twice the other rows' 3.
PLANNED_TIME_STEPS = 6


# what a configuration costs besides its timed steps, in steps: the prime (a forward and
# backward that counts the saved activations too), the warm-up, the memory step (about two:
# every large allocation faults its pages in), the step that grows the heap and the forward
CONFIG_OVERHEAD_STEPS = 5.0


# a measuring process's start: Python, torch and transformers imported, the model loaded
PROCESS_START_S = 15.0


# each further configuration of a shared process: the model built again from the loaded files
CONFIG_BUILD_S = 2.0


# the timed part of a configuration besides its timed steps, in steps: the step that grows the
# heap and the forward timing
TIMING_OVERHEAD_STEPS = 2.0


def _step_of(o: Option, step_s: float, tokens_per_step: float, images: bool) -> float:
    """A step's time in proportion to its tokens (checkpointing recomputes a forward). An
    image step counts images, as its batches do: a configuration's `seq_len` is then the
    chain's patch tokens or side, the same for every configuration."""
    tokens = (1 if images else o.seq_len) * o.micro_batch * min(o.grad_accum, 2)
    return step_s * tokens / max(1.0, tokens_per_step) * (1.3 if o.checkpointing else 1.0)


def _timed(o: Option, own: str) -> int:
    return PLANNED_TIME_STEPS if o.label == own else 3


def expected_seconds(
    options: list[Option],
    own: str,
    step_s: float,
    tokens_per_step: float,
    start_s: float,
    build_s: float = CONFIG_BUILD_S,
    images: bool = False,
) -> float:
    """How long measuring `options` in one process takes, from a step of `step_s` seconds over
    `tokens_per_step` tokens: `start_s` for the process, `build_s` for each configuration after
    the first (`build_s=start_s`: a fresh process for each)."""
    total = start_s
    for i, o in enumerate(options):
        steps = CONFIG_OVERHEAD_STEPS + _timed(o, own)
        total += (build_s if i else 0.0) + _step_of(o, step_s, tokens_per_step, images) * steps
    return total


def timing_seconds(
    options: list[Option],
    own: str,
    step_s: float,
    tokens_per_step: float,
    build_s: float,
    images: bool = False,
) -> float:
    """How long the timed part of `options` takes once their memory is measured (a shared
    process): the model built again, the step that grows the heap, the timed steps, the
    forward."""
    return sum(
        build_s
        + _step_of(o, step_s, tokens_per_step, images) * (TIMING_OVERHEAD_STEPS + _timed(o, own))
        for o in options
    )


def _clock_text(seconds: float) -> str:
    return f"about {seconds / 60:.0f} min" if seconds >= 90 else f"about {seconds:.0f} s"


def _processes_text(count: int, shared: bool) -> str:
    where = "in one process" if shared else "each in its own process"
    return f"{count} configurations {where}"


def sizing_forecast(study: Study, options: list[Option], own: str, shared: bool = True) -> str:
    """A sentence saying how long the sizing will take, from the latest smoke's step time (the
    only step measured before), or that it is known after the first configuration."""
    found = latest(study, "smoke", "smoke.json")
    smoke, row = (Smoke.read(found.path), found.row) if found else (None, None)
    what = _processes_text(len(options), shared)
    if not smoke or not smoke.step_s or not smoke.tokens_per_step:
        return f"{what} (time known after the first)"
    start = smoke.fresh_process_s or PROCESS_START_S
    images = study.config.task.kind == "image_classification"
    seconds = expected_seconds(
        options, own, smoke.step_s, smoke.tokens_per_step, start,
        build_s=CONFIG_BUILD_S if shared else start, images=images,
    )  # fmt: skip
    unit = "images" if images else "tokens"
    return (
        f"{what}: {_clock_text(seconds)} "
        f"(smoke {row.id}: {smoke.step_s:.1f} s a step of {smoke.tokens_per_step:.0f} {unit})"
    )


def _remaining(
    done: list[tuple[Option, float]],
    left: list[Option],
    own: str,
    first: SizingMeasured | None,
    shared: bool,
    images: bool,
) -> str:
    """How long the configurations `left` take, at the first measured step's time per token.
    Fresh processes: each as the measured ones took beyond their steps. One process: results
    come in once every memory is measured, so what is left is their timed part."""
    if not left or not first or not first.step_s or not first.tokens_per_step:
        return ""
    step_s, tokens = first.step_s, first.tokens_per_step
    if shared:
        seconds = timing_seconds(left, own, step_s, tokens, CONFIG_BUILD_S, images)
        return f"{_clock_text(seconds)} left"
    costs = [
        max(0.0, s - expected_seconds([o], own, step_s, tokens, 0.0, images=images))
        for o, s in done
    ]
    start = sum(costs) / len(costs) if costs else PROCESS_START_S
    seconds = expected_seconds(left, own, step_s, tokens, start, start, images)
    return f"{_clock_text(seconds)} left"


class RowProgress:
    """The progress line once a configuration's result is in (in the order they end), with
    how long the rest will take."""

    def __init__(
        self,
        planned: list[Option],
        own: str,
        total: int,
        shared: bool,
        progress: Progress | None,
        images: bool = False,
    ):
        self.planned, self.own, self.total, self.shared = planned, own, total, shared
        self.images = images
        self.progress = progress
        self.done: list[tuple[Option, float]] = []
        self.timed: list[SizingMeasured] = []
        self.finished: set[int] = set()
        self.clock = time.perf_counter()

    def __call__(self, i: int, row: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.done.append((self.planned[i], now - self.clock))
        self.clock = now
        measured = SizingConfiguration.of(WRITING, row, f"configurations[{i}]").measurement
        if measured.step_s:
            self.timed.append(measured)
        self.finished.add(i)
        left = [o for j, o in enumerate(self.planned) if j not in self.finished]
        if self.progress and left:
            first = self.timed[0] if self.timed else None
            note = _remaining(self.done, left, self.own, first, self.shared, self.images)
            n = len(self.done)
            self.progress("size", n, self.total, f"{n} of {len(self.planned)} measured; {note}")
