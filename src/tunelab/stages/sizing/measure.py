"""Configurations measured in a child process: `python -m tunelab.stages.sizing.measure SPEC`.

The parent (`tunelab.stages.sizing.processes`) gives one child all the configurations of a sizing
(or, `--fresh-processes`, one each). For each, the child builds the study's model through
`tunelab.lib.models` as training builds it, adapted, with synthetic examples of exactly the asked
length, and runs real optimizer steps through the training loop itself
(`tunelab.stages.train.loop.train_loop`: forward, token-normalized loss, backward, gradient clipping,
optimizer step, zero grad): a warm-up, then the measured steps. It is a `tunelab.core.worker`;
each configuration's result is a file of its own (`result_path`), written as soon as known.

The warm-up makes what a first step leaves for good: the optimizer's states. Fresh processes
(`spec["warmup"] == "step"`) take a whole warm-up step for it, pinned and so about twice a
step's time; one process for all (`"states"`) makes the states with one optimizer step over
zero gradients (`_make_states`), the lazy one-time allocations of forward and backward having
been made by the prime already. The prime (`_prime`, a forward and backward before `idle` is
read) also counts the bytes autograd saves in its forward (`facts.count_saved_bytes` with its
backward: the same bytes as a forward counted alone, `saved_activation_bytes`).

Order (`run_configurations`): first the memory of every configuration, one after another with
the mmap threshold pinned, each on a model built for it after the previous one's memory was
given back (`settle`: garbage collected, `malloc_trim`, threshold pinned again; on CUDA the
cache emptied and the peak stats reset); then, with glibc's usual thresholds, the step time of
each that fits, from the largest peak to the smallest, the last configuration on the model it
has when it comes first, the others on a model built again. Memory
before any unpinned step: a heap grown by unpinned steps keeps free chunks that later
allocations take before any mmap, and a step measured after them would show the heap's
high-water mark rather than its live tensors, whereas configurations measured pinned one
after another give what fresh processes give (docs/sizing.md; tests/stages/sizing/test_sizing.py;
benchmarks/sizing_time.py).

Memory:
- CUDA: `max_memory_allocated` and `max_memory_reserved` over the measured steps (peak stats
  reset after the warm-up), and the allocated bytes before the first step (weights and batch).
- CPU (Linux): the resident set size. `idle` is the RSS once the model, the optimizer and the
  batches exist, before the first step; the peak high-water mark (VmHWM) is reset after the
  warm-up (`/proc/self/clear_refs` 5) and read after the measured steps. The measured increase
  `peak - idle` is what a training step adds to the process: optimizer states, gradients,
  activations, logits and temporaries, the part the analytic model predicts. Before `idle` and
  before the reset the heap's free pages are returned (`malloc_trim`): what the measured step
  takes from the heap then shows in the RSS, not only what it maps.

Time: the median of `time_steps` (3) steps at most after one untimed step that lets the heap
grow, fewer when the last two agree within 5 % (`stable_times`: more would not move the
median). The pinned threshold that keeps the RSS honest makes every large allocation a
page-faulting mmap (a CPU step about twice as slow as in a training run); the timed steps run
with glibc's own thresholds, so the step time is that of a training run. Then one no-grad
forward in eval mode is timed after an untimed one (`forward_s`, the validation forward).
What a process's earlier timings leave (`TimedBefore`) is not made again: a configuration
whose peak is at most one timed before it runs its timed steps on the heap that one grew,
without the untimed step (`heap_grown_before`); once one forward was timed the next is not
warmed; a configuration whose forward is that of one timed before (the same spec but for
activation checkpointing, which a no-grad forward does not use) takes its time (`forward_of`).
A fresh process, with one configuration, always does all. `measured.phase_s` gives the
seconds of each part (load, prime with the count, memory_steps, timing_load, timed_steps,
forward).

Out of memory (CUDA OutOfMemoryError, MemoryError, a failed CPU allocation) or an RSS above
`memory_budget_bytes` (a watchdog thread stops the child at once, after writing the verdict of
the configuration it was on) is reported as `status: does_not_fit`, never as a crash of the
caller; the parent gives the configurations left to a new child.

SPEC is `{"configurations": [spec, ...]}`; each result goes to `configuration-<i>.json`, a
memory-phase verdict to `memory-<i>.json`, the phase to `phase.json`.
The model and loop each configuration runs on are `sizing.session`'s (synthetic examples from
`sizing.child_model.synthetic_examples`, `pixel_values` for an image model); the timed part is
`sizing.step_time`'s. The child needs
`tunelab.stages.train.build` (`build_model`, `build_loop`), `tunelab.stages.train.loop`
(`train_loop`, `loss_sum`, `validation_loss`, `autocast`, `to_device`) and
`tunelab.stages.train.batches.Position`.
"""

from __future__ import annotations

import gc
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core.record_sizing import SizingResult, SizingSpec
from tunelab.core.records import write_json_atomic
from tunelab.core.worker import SPEC, serve
from tunelab.stages.sizing.child_model import (
    collect,
    is_oom,
    spec_of,
)
from tunelab.stages.sizing.process_memory import (
    Watchdog,
    hwm_bytes,
    pin_mmap_threshold,
    release_mmap_threshold,
    reset_hwm,
    rss_bytes,
    trim_heap,
)
from tunelab.stages.sizing.session import Session, Steps, build_session, marker
from tunelab.stages.sizing.step_time import TimedBefore, measure_time


def _child_device(spec: SizingSpec) -> Any:
    import torch

    from tunelab.lib.models import compute_device

    wanted = spec.device or "auto"
    return {  # CUDA with its index: the memory-fraction call refuses a bare "cuda"
        "auto": compute_device,
        "cuda": lambda: torch.device("cuda", torch.cuda.current_device()),
    }.get(wanted, lambda: torch.device(wanted))()


def _limit_memory(device: Any, budget: int | None) -> Watchdog | None:
    """The budget as CUDA's memory fraction, or a watchdog on the RSS (which counts the whole
    process from the start, loading included)."""
    import torch

    if device.type == "cuda" and budget:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    if device.type == "cpu" and budget and rss_bytes() is not None:
        watchdog = Watchdog(int(budget))
        watchdog.start()
        return watchdog
    return None


@dataclass
class _Memory:
    """What the memory steps found (bytes; `wall`: the measured steps' seconds)."""

    warmup_steps: int
    idle_rss: int | None = None
    idle_rss_after_warmup: int | None = None
    hwm_reset: bool = False
    idle_allocated: int = 0
    warmup_max_allocated: int = 0
    wall: float = 0.0


def _memory_steps(steps: Steps, warmup: int, measured: int, states: bool) -> _Memory:
    """The warm-up (optimizer states, lazy init): `warmup` steps, or with `states` the
    optimizer's states made by a step over zero gradients (`_make_states`); then the measured
    steps, with the memory before, between and after them (the module docstring says which)."""
    import torch

    cuda = steps.device.type == "cuda"
    collect(cuda)
    idle_allocated = 0
    if cuda:
        torch.cuda.synchronize()
        idle_allocated = torch.cuda.memory_allocated(steps.device)
        torch.cuda.reset_peak_memory_stats(steps.device)
    idle_rss = rss_bytes()
    if states:
        _make_states(steps.loop.optimizer)
        warmup = 0
    else:
        steps.run_to(warmup)
    collect(cuda)
    out = _Memory(warmup, idle_rss, rss_bytes(), reset_hwm(), idle_allocated)
    if cuda:
        torch.cuda.synchronize()
        out.warmup_max_allocated = torch.cuda.max_memory_allocated(steps.device)
        torch.cuda.reset_peak_memory_stats(steps.device)
    started = time.perf_counter()
    steps.run_to(warmup + measured)
    if cuda:
        torch.cuda.synchronize()
    out.wall = time.perf_counter() - started
    return out


def _make_states(optimizer: Any) -> None:
    """The optimizer's states as its first step makes them, without a forward and backward:
    one step over zero gradients (no update but weight decay), then the gradients dropped as
    the loop's zero grad drops them."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_configurations(specs: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Measure `specs` in this process: first the memory of each, one after another with the
    mmap threshold pinned (`memory-<i>.json` as soon as known), then, with glibc's usual
    thresholds, the step time of each that fits (`configuration-<i>.json`, the whole result).

    Memory first: a heap grown by unpinned steps keeps free chunks that later allocations
    reuse before any mmap, and the RSS of a step measured after them would follow the heap's
    high-water mark instead of the live tensors. Before each configuration the previous one's
    memory is given back (`settle`). The timing goes from the largest peak to the smallest
    (`measure_time`: the heap the first grows holds the steps of the next); the last
    configuration's model goes on to its timed steps as it is when it comes first, the others
    are built again for theirs. `out/phase.json` says which configuration
    runs in which phase, for the parent to know where a process that ended early stopped.
    The threads, the device and the budget are the first spec's (one study's configurations).
    """
    import torch

    typed = specs_of(specs, out / SPEC)
    first = typed[0]
    if first.num_threads:
        torch.set_num_threads(first.num_threads)
    device = _child_device(first)
    watchdog = _limit_memory(device, first.memory_budget_bytes)
    pinned = first.pinned
    fitted: dict[int, dict[str, Any]] = {}
    peaks: dict[int, int] = {}  # the fitted ones' peak bytes
    kept: Session | None = None
    for i, spec in enumerate(specs):
        kept = None
        settle(device, pinned=pinned)
        _phase(out, "memory", i)
        result: dict[str, Any] = {"label": typed[i].label, "device": device.type}
        if watchdog is not None:
            watchdog.aim(result_path(out, i, "memory"), result)
        measure = measure_memory
        if typed[i].peak == "evaluation":
            from tunelab.stages.sizing.measure_peaks import measure_evaluation as measure
        session, result = _guarded(result, measure, spec, device, result)
        if watchdog is not None:
            watchdog.pause()
        written = write_json_atomic(result_path(out, i, "memory"), result, overwrite=True)
        found = SizingResult.of(written, result)
        if typed[i].peak:  # a peak is memory alone: its result is final
            write_json_atomic(result_path(out, i), result, overwrite=True)
        elif found.status == "ok":
            fitted[i], peaks[i] = result, found.measurement.peak_total or 0
            kept = session
        session = None
    if device.type == "cpu" and pinned and fitted:
        release_mmap_threshold()
    before = TimedBefore()
    # the largest first: the heap its steps grow holds the later ones' steps
    order = sorted(fitted, key=lambda i: -peaks[i])
    for i in order:
        session = kept if kept is not None and i == len(specs) - 1 else None
        kept = None
        if session is None:
            settle(device, pinned=False)
        _phase(out, "timing", i)
        _, timed = _guarded(fitted[i], measure_time, specs[i], device, fitted[i], session, before)
        session = None
        write_json_atomic(result_path(out, i), timed, overwrite=True)
    return {"configurations": len(specs)}


def _guarded(result: dict[str, Any], run: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """`run(*args)` as a pair (a lone result as (None, it)), or on an exception (None, `result`
    with status error and the whole error)."""
    try:
        out = run(*args)
    except Exception as exc:  # noqa: BLE001 - one configuration's error, the next still run
        from tunelab.core.worker import describe_error

        error = describe_error(exc)
        del exc
        return None, {
            **result,
            "status": "error",
            "reason": f"{error['kind']}: {error['message']}",
            "traceback": error["traceback"],
        }
    return out if isinstance(out, tuple) else (None, out)


def specs_of(specs: list[dict[str, Any]], path: Path) -> list[SizingSpec]:
    """The configurations of the worker spec at `path`, read as their kind."""
    return [SizingSpec.of(path, s, f"configurations[{i}]") for i, s in enumerate(specs)]


def _phase(out: Path, phase: str, index: int) -> None:
    write_json_atomic(out / "phase.json", {"phase": phase, "index": index}, overwrite=True)


def result_path(out: Path, index: int, phase: str = "configuration") -> Path:
    """Where the child leaves configuration `index`'s result: `memory-<i>.json` after its
    memory steps, `configuration-<i>.json` once timed too."""
    return out / f"{phase}-{index}.json"


def settle(device: Any, *, pinned: bool) -> None:
    """What the previous configuration left, given back before the next one is built: garbage
    collected; on CPU the heap's free pages returned (`malloc_trim`) and the mmap threshold
    pinned; on CUDA the cached blocks released and the peak stats reset."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    elif pinned:
        pin_mmap_threshold()
        trim_heap()


def measure_memory(
    spec: dict[str, Any], device: Any, result: dict[str, Any]
) -> tuple[Session | None, dict[str, Any]]:
    """The memory part of a configuration, in this process: (its session for the timed steps,
    `result` with status, the memory figures and the model's facts)."""
    import torch

    phases: dict[str, float] = {}
    mark = marker(phases)
    try:
        session = build_session(spec, device)
    except Exception as exc:  # noqa: BLE001 - the verdict travels back to the parent
        if is_oom(exc):
            return None, {**result, "status": "does_not_fit", "reason": f"loading: {exc}"[:500]}
        raise
    mark("load")
    model, loop, t, arch = session.model, session.loop, session.training, session.arch
    result["facts"] = session.facts.to_dict()
    typed = spec_of(spec)
    warmup, measure_steps, _ = typed.steps()
    model.train()  # dropout and checkpointing act only in training mode
    count = True if typed.count_saved is None else typed.count_saved
    saved = _prime(model, loop.source, arch, t.precision, device, count, loop.optimizer)
    mark("prime")
    steps = session.steps
    try:
        memory = _memory_steps(steps, warmup, measure_steps, typed.warmup == "states")
    except Exception as exc:  # noqa: BLE001
        if is_oom(exc):
            out = {**result, "status": "does_not_fit", "reason": f"{type(exc).__name__}: {exc}"}
            if device.type == "cuda":
                out["measured"] = {"max_allocated": torch.cuda.max_memory_allocated(device)}
            return None, out
        raise
    mark("memory_steps")
    warmup = memory.warmup_steps
    rows = steps.metrics
    measured_rows = rows[warmup:]
    peak = hwm_bytes() if device.type == "cpu" and memory.hwm_reset else None
    measured: dict[str, Any] = {
        "memory_step_s": [r.seconds for r in measured_rows],
        "memory_wall_s": memory.wall / max(1, measure_steps),
        "warmup_step_s": rows[0].seconds if warmup and rows else None,
        "warmup": "optimizer states" if memory.warmup_steps == 0 else "steps",
        "tokens_per_step": measured_rows[0].tokens if measured_rows else 0,
        "examples_per_step": t.micro_batch_size * t.grad_accum_steps,
        "saved_activation_bytes": saved,
        "load_s": session.load_s,
        "loss": measured_rows[-1].loss if measured_rows else None,
        "phase_s": phases,
    }
    budget = typed.memory_budget_bytes
    return session, _verdict(result, measured, memory, peak, device, budget)


def _verdict(
    result: dict[str, Any],
    measured: dict[str, Any],
    memory: _Memory,
    peak: int | None,
    device: Any,
    budget: int | None,
) -> dict[str, Any]:
    """The memory figures of the device added to `measured`, and the status."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        max_allocated = torch.cuda.max_memory_allocated(device)
        measured.update(
            idle_allocated=memory.idle_allocated,
            warmup_max_allocated=memory.warmup_max_allocated,
            max_allocated=max_allocated,
            max_reserved=torch.cuda.max_memory_reserved(device),
            total_memory=props.total_memory,
            cuda_major=props.major,
        )
        measured["peak_total"] = max_allocated
        measured["increase"] = max_allocated - memory.idle_allocated
        return {**result, "status": "ok", "measured": measured}
    idle = memory.idle_rss
    measured.update(
        idle_rss=idle,
        idle_rss_after_warmup=memory.idle_rss_after_warmup,
        peak_rss=peak,
        peak_total=peak,
        increase=(peak - idle) if peak is not None and idle is not None else None,
    )
    if budget and peak and peak > budget:
        return {
            **result,
            "status": "does_not_fit",
            "reason": f"peak RSS {peak / 2**20:.0f} MiB above the budget",
            "measured": measured,
        }
    return {**result, "status": "ok", "measured": measured}


def _prime(  # noqa: ANN001, PLR0913
    model, source, arch, precision, device, count: bool, optimizer: Any = None
) -> int | None:
    """One forward and backward of a micro-batch before `idle` is read, with no optimizer
    step on the model: the lazy one-time allocations of the runtime (autograd engine, thread
    pools, kernel and primitive caches for these shapes) then sit in `idle` rather than in the
    measured increase, which keeps what a step adds: optimizer states, gradients, activations.
    With `optimizer`, the step's other code runs once too (`_warm_update`). With `count`, its
    forward also counts the bytes autograd keeps (`count_saved_bytes`: the activations term),
    returned."""
    import torch

    from tunelab.stages.sizing.facts import count_saved_bytes
    from tunelab.stages.train.batches import Position
    from tunelab.stages.train.loop import autocast, loss_sum, to_device

    first = source.next(Position())[0][0]
    batch = to_device({k: v for k, v in first.items() if v.dim() > 0}, device)

    def forward() -> Any:
        with autocast(precision, device):
            return loss_sum(model, batch, arch)

    with torch.enable_grad():
        if count:
            saved = count_saved_bytes(model, forward, lambda loss: loss.backward())
        else:
            forward().backward()
            saved = None
    if optimizer is not None:
        _warm_update(model, optimizer)
    model.zero_grad(set_to_none=True)
    return saved


def _warm_update(model: Any, optimizer: Any) -> None:
    """The step's gradient clipping over the prime's gradients, and one step of a throwaway
    optimizer like `optimizer` over one stand-in tensor per dtype and device of its parameters.
    The first run of that code maps the library pages that hold it: counted in the file-backed
    RSS (docs/sizing.md gives the size), they would otherwise land in the first measured
    increase of the process, while the optimizer's states stay for the measured step to make."""
    import torch

    grads = [p for p in model.parameters() if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grad_norm_(grads, float("inf"))
    kinds = {
        (p.dtype, p.device)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad
    }
    # 4096 elements: bitsandbytes keeps 32-bit states for smaller tensors (min_8bit_size)
    stand_ins = [torch.zeros(4096, dtype=d, device=dev, requires_grad=True) for d, dev in kinds]
    if not stand_ins:
        return
    for t in stand_ins:
        t.grad = torch.ones_like(t)
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    cls(stand_ins, **{k: v for k, v in optimizer.defaults.items() if k in accepted}).step()


def _measure(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """The worker's body: `spec["configurations"]` measured in turn (see `run_configurations`)."""
    return run_configurations(spec["configurations"], out)


if __name__ == "__main__":
    sys.exit(serve(_measure))
