"""The step time of a configuration whose memory fitted, in the measuring child
(`tunelab.stages.sizing.measure`): with glibc's usual thresholds, after one untimed step that
lets the heap grow, the median of at most `time_steps` steps, fewer once the last two agree
(`stable_times`); then one no-grad forward in eval mode. What earlier timings in the process
left (a grown heap, a warmed or timed forward: `TimedBefore`) is not made again.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.record_sizing import SizingResult
from tunelab.stages.sizing.child_model import spec_of
from tunelab.stages.sizing.process_memory import release_mmap_threshold
from tunelab.stages.sizing.session import Session, Steps, build_session, marker

# the timed steps stop once the last STABLE_STEPS of them agree within STABLE_TOLERANCE
STABLE_STEPS = 2


STABLE_TOLERANCE = 0.05


def stable_times(seconds: list[float]) -> bool:
    """Whether the last `STABLE_STEPS` step times agree within `STABLE_TOLERANCE` of their
    mean: more steps would not move the median the sizing reports."""
    last = seconds[-STABLE_STEPS:]
    if len(last) < STABLE_STEPS:
        return False
    mean = sum(last) / len(last)
    return mean > 0 and (max(last) - min(last)) <= STABLE_TOLERANCE * mean


def _timed_steps(
    steps: Steps, timed: int, grow: bool = True
) -> tuple[list[float], str, float | None]:
    """Further steps for the step time, at most `timed`, fewer once `stable_times` holds:
    (their seconds, allocator, their CPU share).

    The pinned mmap threshold that makes the RSS honest also makes every large allocation a
    fresh mmap with its page faults (a CPU step about twice as slow as in a training run), so
    these steps run with glibc's usual thresholds, after one step that lets the heap grow
    (`grow`; without it the heap is the one the previous configuration's steps grew).
    """
    import torch

    from tunelab.core.env import cpu_share

    allocator = "as measured"
    if steps.device.type == "cpu" and release_mmap_threshold():
        allocator = "released"
        if grow:
            steps.run_to(len(steps.metrics) + 1)  # one step to let the heap grow, not timed
    wall_started, cpu_started = time.perf_counter(), time.process_time()
    first = len(steps.metrics)
    while len(steps.metrics) - first < timed:
        steps.run_to(len(steps.metrics) + 1)
        if stable_times([r.seconds for r in steps.metrics[first:]]):
            break
    timed = len(steps.metrics) - first
    share = cpu_share(
        time.process_time() - cpu_started,
        time.perf_counter() - wall_started,
        torch.get_num_threads(),
        steps.device,
    )
    return [r.seconds for r in steps.metrics[-timed:]], allocator, share


@dataclass
class TimedBefore:
    """What the configurations timed before in this process leave the next one: a heap their
    released steps grew (the largest peak among them), a warmed no-grad forward, and its
    seconds for each model and shape (`_forward_key`) with the label of the configuration that
    measured them."""

    heap_peak: int = 0
    forwards: dict[str, tuple[float, Any]] = field(default_factory=dict)


def _forward_key(spec: dict[str, Any]) -> str:
    """What a no-grad forward in eval mode depends on: the whole spec but the label, the timed
    steps' count and activation checkpointing (which acts only in training with gradients)."""
    drop = ("label", "time_steps", "checkpointing")
    return json.dumps({k: v for k, v in spec.items() if k not in drop}, sort_keys=True)


def measure_time(
    spec: dict[str, Any],
    device: Any,
    result: dict[str, Any],
    session: Session | None,
    before: TimedBefore | None = None,
) -> dict[str, Any]:
    """The step time of a configuration whose memory fitted (`result`), with glibc's usual
    thresholds: on `session` where its model is still there, else on one built again. After
    other configurations in this process (`before`), the heap they grew is not grown again, the
    forward they warmed not warmed again, and a forward they timed not timed again (the
    configurations are timed largest first, so that the heap is grown once)."""
    before = before if before is not None else TimedBefore()
    started = time.perf_counter()
    session = session or build_session(spec, device)
    found = SizingResult.of(Path("memory-<i>.json"), result).measurement
    typed = spec_of(spec)
    measured = dict(found.raw)
    phases = measured["phase_s"] = dict(found.phase_s or {})
    phases["timing_load"] = round(time.perf_counter() - started, 3)
    mark = marker(phases)
    budget = typed.memory_budget_bytes
    timed = typed.steps()[2] if found.memory_step_s else 0
    if budget and (found.peak_rss or 0) > 0.8 * budget:
        timed = 0  # a heap that keeps freed memory could cross the budget: time as measured
    peak = found.peak_total or 0
    grown = 0 < peak <= before.heap_peak
    seconds, allocator, timed_cpu = (
        _timed_steps(session.steps, timed, grow=not grown) if timed else ([], "as measured", None)
    )
    if allocator == "released":
        before.heap_peak = max(before.heap_peak, peak)
    mark("timed_steps")
    seconds = seconds or found.memory_step_s
    key = _forward_key(spec)
    if key not in before.forwards:
        t, warmed = session.training, bool(before.forwards)
        forward_s = _time_forward(
            session.model, session.loop.source, session.arch, t.precision, device, not warmed
        )
        before.forwards[key] = (forward_s, typed.label)
    forward_s, forward_of = before.forwards[key]
    mark("forward")
    step_s = statistics.median(seconds) if seconds else found.memory_wall_s
    tokens, examples = found.tokens_per_step, found.examples_per_step
    measured.update(
        step_s=step_s,
        step_s_all=seconds,
        step_s_allocator=allocator,
        tokens_per_s=tokens / step_s if step_s else None,
        examples_per_s=examples / step_s if step_s else None,
        forward_s=forward_s,
        # the configuration whose forward was timed (the same model and shape), and whether
        # the timed steps ran on a heap a larger configuration's steps had grown
        forward_of=forward_of,
        heap_grown_before=grown,
        # the timed steps' share of their threads' CPU time: low when another process shared
        # the cores, and the step time with it (tunelab plan warns)
        cpu_share=timed_cpu,
    )
    return {**result, "measured": measured}


def _time_forward(model, source, arch, precision, device, warm: bool) -> float:  # noqa: ANN001
    """Seconds of one no-grad forward of a micro-batch in eval mode (validation loss), after
    an untimed one where `warm`."""
    import torch

    from tunelab.stages.train.batches import Position
    from tunelab.stages.train.loop import validation_loss

    batch = source.next(Position())[0][:1]
    model.eval()
    with torch.no_grad():
        if warm:
            validation_loss(model, batch, arch, precision)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        validation_loss(model, batch, arch, precision)
        if device.type == "cuda":
            torch.cuda.synchronize()
    model.train()
    return time.perf_counter() - started
