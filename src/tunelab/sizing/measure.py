"""One configuration measured in its own process: `python -m tunelab.sizing.measure SPEC`.

A fresh process per configuration, so that one measurement does not inherit the allocator state,
the caches or the peak of another. The child loads the study's model through `tunelab.models`,
adapts it, builds synthetic examples of exactly the asked length, and runs real optimizer steps
through the training loop itself (`tunelab.train.loop.train_loop`: forward, token-normalized
loss, backward, gradient clipping, optimizer step, zero grad): a warm-up step, then the measured
steps. It is a `tunelab.worker`: its result comes back as the worker's result.json.

Memory:
- CUDA: `max_memory_allocated` and `max_memory_reserved` over the measured steps (peak stats
  reset after the warm-up), and the allocated bytes before the first step (weights and batch).
- CPU (Linux): the resident set size. `idle` is the RSS once the model, the optimizer and the
  batches exist, before the first step; the peak high-water mark (VmHWM) is reset after the
  warm-up (`/proc/self/clear_refs` 5) and read after the measured steps. The measured increase
  `peak - idle` is what a training step adds to the process: optimizer states, gradients,
  activations, logits and temporaries, the part the analytic model predicts.

Time: the median of `time_steps` (3) further steps at most, fewer when the last two agree
within 5 % (`stable_times`: more would not move the median). On CPU the parent pins glibc's
mmap threshold so that the RSS follows the live tensors, which also makes every large
allocation a page-faulting mmap; before the timed steps the child gives glibc its usual thresholds back and runs one step to
let the heap grow, so the step time is that of a training run.

Out of memory (CUDA OutOfMemoryError, MemoryError, a failed CPU allocation) or an RSS above
`memory_budget_bytes` (a watchdog thread stops the child at once) is reported as
`status: does_not_fit`, never as a crash of the caller.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.worker import Worker, serve, write_result

# glibc serves blocks above this size with mmap and returns them to the system when freed. Its
# default threshold moves up (to 32 MiB) after the first frees, and freed activations then stay in
# the heap: the RSS keeps the warm-up's peak and grows with fragmentation instead of following the
# live tensors. Pinning it makes the RSS of the child measure what the step's tensors need.
MMAP_THRESHOLD = 65536
# the timed steps stop once the last STABLE_STEPS of them agree within STABLE_TOLERANCE
STABLE_STEPS = 2
STABLE_TOLERANCE = 0.05
_OOM_WORDS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
)


# ------------------------------------------------------------------ process memory (Linux)


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


class _Watchdog(threading.Thread):
    """Stops the process as soon as its RSS passes the budget, after writing the verdict."""

    def __init__(self, budget: int, base: dict[str, Any], out: Path):
        super().__init__(daemon=True)
        self.budget = budget
        self.base = base
        self.out = out
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.002):
            rss = rss_bytes()
            if rss is not None and rss > self.budget:
                write_result(
                    self.out,
                    {
                        **self.base,
                        "status": "does_not_fit",
                        "reason": f"RSS {rss / 2**20:.0f} MiB passed the memory budget "
                        f"{self.budget / 2**20:.0f} MiB",
                        "measured": {"peak_rss": rss},
                    },
                )
                os._exit(0)


# ------------------------------------------------------------------ synthetic examples


def synthetic_examples(
    count: int,
    seq_len: int,
    architecture: str,
    *,
    vocab: int,
    num_labels: int = 2,
    loss_fraction: float = 1.0,
    seed: int = 0,
    low_id: int = 5,
    image_size: int | None = None,
) -> list[dict[str, Any]]:
    """`count` encoded examples of exactly `seq_len` tokens, in the Preprocessor's shape.

    causal_lm: the last `loss_fraction` of the positions carry loss (the target after the prompt).
    image: `pixel_values` [3, image_size, image_size] (seq_len is then the patch tokens).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    if architecture == "image":
        size = int(image_size or 224)
        return [
            {
                "id": f"synthetic-{i}",
                "pixel_values": torch.randn((3, size, size), generator=g),
                "label": i % max(1, num_labels),
            }
            for i in range(count)
        ]
    hi = max(low_id + 1, vocab)
    out = []
    for i in range(count):
        ids = torch.randint(low_id, hi, (seq_len,), generator=g).tolist()
        e: dict[str, Any] = {"id": f"synthetic-{i}", "input_ids": ids, "truncated": False}
        if architecture == "causal_lm":
            prompt = min(seq_len - 2, max(0, round(seq_len * (1.0 - loss_fraction))))
            e["labels"] = [-100] * prompt + ids[prompt:]
        else:
            e["label"] = i % max(1, num_labels)
        out.append(e)
    return out


# ------------------------------------------------------------------ the child


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _OOM_WORDS)


def _build(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any, Any]:
    """Config, base, model (built as training builds it, on `device`), facts."""
    from tunelab.config import validate_config
    from tunelab.models import resolve_model
    from tunelab.sizing.facts import model_facts
    from tunelab.train.build import build_model

    raw = json.loads(json.dumps(spec["config"]))
    t = raw.setdefault("training", {})
    t.update(
        micro_batch_size=spec["micro_batch"],
        grad_accum_steps=spec.get("grad_accum", 1),
        precision=spec.get("precision", t.get("precision", "fp32")),
        activation_checkpointing=bool(spec.get("checkpointing", False)),
        packing=bool(spec.get("packing", t.get("packing", True))),
    )
    cfg = validate_config(raw, source="sizing spec")
    root = Path(spec["root"]) if spec.get("root") else None
    base = resolve_model(cfg.model, root=root)
    model, _audit = build_model(base, cfg, spec.get("labels"), device)
    lora = cfg.adaptation.method in ("lora", "qlora")
    facts = model_facts(
        model,
        base.architecture,
        lora_rank=cfg.adaptation.rank if lora else 0,
        lora_dropout=cfg.adaptation.dropout if lora else 0.0,
    )
    return cfg, base, model, facts


def _child_device(spec: dict[str, Any]) -> Any:
    import torch

    from tunelab.models import compute_device

    wanted = spec.get("device", "auto")
    return {  # CUDA with its index: the memory-fraction call refuses a bare "cuda"
        "auto": compute_device,
        "cuda": lambda: torch.device("cuda", torch.cuda.current_device()),
    }.get(wanted, lambda: torch.device(wanted))()


def _limit_memory(
    device: Any, budget: int | None, result: dict[str, Any], out: Path
) -> _Watchdog | None:
    """The budget as CUDA's memory fraction, or a watchdog on the RSS (which counts the whole
    process from the start, loading included)."""
    import torch

    if device.type == "cuda" and budget:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    if device.type == "cpu" and budget and rss_bytes() is not None:
        watchdog = _Watchdog(int(budget), result, out)
        watchdog.start()
        return watchdog
    return None


@dataclass
class _Steps:
    """The loop of the measurement and every step's metrics row so far."""

    loop: Any
    device: Any
    state: Any = None
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def run_to(self, total_steps: int) -> None:
        from tunelab.train.loop import TrainState, train_loop

        self.loop.total_steps = total_steps
        state = self.state or TrainState()
        self.state = train_loop(self.loop, state, [lambda _s, row: self.metrics.append(row)])


def _memory_steps(steps: _Steps, warmup: int, measured: int) -> dict[str, Any]:
    """The warm-up steps (optimizer states, lazy init), then the measured ones, with the memory
    before, between and after them (the module docstring says which)."""
    import torch

    cuda = steps.device.type == "cuda"
    out: dict[str, Any] = {}
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        out["idle_allocated"] = torch.cuda.memory_allocated(steps.device)
        torch.cuda.reset_peak_memory_stats(steps.device)
    out["idle_rss"] = rss_bytes()
    steps.run_to(warmup)
    gc.collect()
    out["idle_rss_after_warmup"] = rss_bytes()
    out["hwm_reset"] = reset_hwm()
    if cuda:
        torch.cuda.synchronize()
        out["warmup_max_allocated"] = torch.cuda.max_memory_allocated(steps.device)
        torch.cuda.reset_peak_memory_stats(steps.device)
    started = time.perf_counter()
    steps.run_to(warmup + measured)
    if cuda:
        torch.cuda.synchronize()
    out["wall"] = time.perf_counter() - started
    return out


def stable_times(seconds: list[float]) -> bool:
    """Whether the last `STABLE_STEPS` step times agree within `STABLE_TOLERANCE` of their
    mean: more steps would not move the median the sizing reports."""
    last = seconds[-STABLE_STEPS:]
    if len(last) < STABLE_STEPS:
        return False
    mean = sum(last) / len(last)
    return mean > 0 and (max(last) - min(last)) <= STABLE_TOLERANCE * mean


def _timed_steps(steps: _Steps, timed: int) -> tuple[list[float], str, float | None]:
    """Further steps for the step time, at most `timed`, fewer once `stable_times` holds:
    (their seconds, allocator, their CPU share).

    The pinned mmap threshold that makes the RSS honest also makes every large allocation a
    fresh mmap with its page faults (a CPU step about twice as slow as in a training run), so
    these steps run with glibc's usual thresholds, after one step that lets the heap grow.
    """
    import torch

    from tunelab.env import cpu_share

    allocator = "as measured"
    if steps.device.type == "cpu" and release_mmap_threshold():
        allocator = "released"
        steps.run_to(len(steps.metrics) + 1)  # one step to let the heap grow, not timed
    wall_started, cpu_started = time.perf_counter(), time.process_time()
    first = len(steps.metrics)
    while len(steps.metrics) - first < timed:
        steps.run_to(len(steps.metrics) + 1)
        if stable_times([r["seconds"] for r in steps.metrics[first:]]):
            break
    timed = len(steps.metrics) - first
    share = cpu_share(
        time.process_time() - cpu_started,
        time.perf_counter() - wall_started,
        torch.get_num_threads(),
        steps.device,
    )
    return [r["seconds"] for r in steps.metrics[-timed:]], allocator, share


def _saved_bytes(model: Any, source: Any, arch: str, precision: str, device: Any) -> int:
    """The bytes autograd keeps, counted on one extra forward (no step): the activations term."""
    import torch

    from tunelab.sizing.facts import count_saved_bytes
    from tunelab.train.batches import Position
    from tunelab.train.loop import autocast, loss_sum, to_device

    batch = to_device(source.next(Position())[0][0], device)
    model.train()  # dropout and checkpointing act only in training mode
    with torch.enable_grad():
        return count_saved_bytes(
            model, lambda: _forward(model, batch, arch, precision, device, autocast, loss_sum)
        )


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration in this process (the body of `python -m tunelab.sizing.measure`)."""
    import torch

    from tunelab.train.build import build_loop

    if spec.get("num_threads"):
        torch.set_num_threads(int(spec["num_threads"]))
    device = _child_device(spec)
    result: dict[str, Any] = {"label": spec.get("label"), "device": device.type}
    budget = spec.get("memory_budget_bytes")
    watchdog = _limit_memory(device, budget, result, Path(spec["out"]))
    load_started = time.perf_counter()
    try:
        cfg, base, model, facts = _build(spec, device)
    except Exception as exc:  # noqa: BLE001 - the verdict travels back to the parent
        if watchdog is not None:
            watchdog.stop.set()
        if _is_oom(exc):
            return {**result, "status": "does_not_fit", "reason": f"loading: {exc}"[:500]}
        raise
    result["facts"] = facts.to_dict()
    load_s = time.perf_counter() - load_started
    t, arch = cfg.training, base.architecture
    warmup = int(spec.get("warmup_steps", 1))
    measure_steps = int(spec.get("measure_steps", 1))
    time_steps = int(spec.get("time_steps", 3))  # after the memory steps, see the module doc
    per_step = t.micro_batch_size * t.grad_accum_steps
    encoded = synthetic_examples(
        per_step,
        int(spec["seq_len"]),
        arch,
        vocab=facts.vocab,
        num_labels=max(2, facts.num_labels),
        loss_fraction=float(spec.get("loss_fraction", 1.0)),
        seed=t.seed,
        image_size=base.config.get("image_size") if arch == "image" else None,
    )
    # the schedule leaves room for the timed steps that follow the measured ones
    total = warmup + measure_steps + 1 + time_steps
    loop = build_loop(model, t, encoded, architecture=arch, pad_id=0, total_steps=total)
    saved = None
    if spec.get("count_saved", True):
        saved = _saved_bytes(model, loop.source, arch, t.precision, device)
    model.train()
    if spec.get("prime", True):
        _prime(model, loop.source, arch, t.precision, device)
    steps = _Steps(loop, device)
    try:
        memory = _memory_steps(steps, warmup, measure_steps)
    except Exception as exc:  # noqa: BLE001
        if _is_oom(exc):
            out = {**result, "status": "does_not_fit", "reason": f"{type(exc).__name__}: {exc}"}
            if device.type == "cuda":
                out["measured"] = {"max_allocated": torch.cuda.max_memory_allocated(device)}
            return out
        raise
    finally:
        if watchdog is not None:
            watchdog.stop.set()
    measured_rows = steps.metrics[warmup:]
    memory_step_s = [r["seconds"] for r in measured_rows]
    peak_now = hwm_bytes() if device.type == "cpu" and memory["hwm_reset"] else None
    timed = time_steps if memory_step_s else 0
    if budget and peak_now and peak_now > 0.8 * budget:
        timed = 0  # a heap that keeps freed memory could cross the budget: time as measured
    seconds, allocator, timed_cpu = (
        _timed_steps(steps, timed) if timed else ([], "as measured", None)
    )
    seconds = seconds or memory_step_s
    forward_s = _time_forward(model, loop.source, arch, t.precision, device)
    step_s = statistics.median(seconds) if seconds else memory["wall"] / max(1, measure_steps)
    tokens = measured_rows[0]["tokens"] if measured_rows else 0
    measured: dict[str, Any] = {
        "step_s": step_s,
        "step_s_all": seconds,
        "step_s_allocator": allocator,
        "memory_step_s": memory_step_s,
        "warmup_step_s": steps.metrics[0]["seconds"] if steps.metrics else None,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s if step_s else None,
        "examples_per_s": per_step / step_s if step_s else None,
        "saved_activation_bytes": saved,
        "forward_s": forward_s,
        "load_s": load_s,
        # the timed steps' share of their threads' CPU time: low when another process shared
        # the cores, and the step time with it (tunelab plan warns)
        "cpu_share": timed_cpu,
        "loss": measured_rows[-1]["loss"] if measured_rows else None,
    }
    return _verdict(result, measured, memory, peak_now, device, budget)


def _verdict(
    result: dict[str, Any],
    measured: dict[str, Any],
    memory: dict[str, Any],
    peak: int | None,
    device: Any,
    budget: int | None,
) -> dict[str, Any]:
    """The memory figures of the device added to `measured`, and the status."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        measured.update(
            idle_allocated=memory["idle_allocated"],
            warmup_max_allocated=memory["warmup_max_allocated"],
            max_allocated=torch.cuda.max_memory_allocated(device),
            max_reserved=torch.cuda.max_memory_reserved(device),
            total_memory=props.total_memory,
            cuda_major=props.major,
        )
        measured["peak_total"] = measured["max_allocated"]
        measured["increase"] = measured["max_allocated"] - memory["idle_allocated"]
        return {**result, "status": "ok", "measured": measured}
    idle = memory["idle_rss"]
    measured.update(
        idle_rss=idle,
        idle_rss_after_warmup=memory["idle_rss_after_warmup"],
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


def release_mmap_threshold() -> bool:
    """Give glibc back thresholds like those it reaches by itself in a long-running process
    (mmap above 32 MiB, trim above 64 MiB). False where there is no glibc `mallopt`."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(
            libc.mallopt(m_mmap_threshold, 32 * 2**20)
            and libc.mallopt(m_trim_threshold, 64 * 2**20)
        )
    except (OSError, AttributeError):
        return False


def _prime(model, source, arch, precision, device) -> None:  # noqa: ANN001
    """One forward and backward of a micro-batch before `idle` is read, with no optimizer
    step: the lazy one-time allocations of the runtime (autograd engine, thread pools, kernel
    and primitive caches for these shapes) then sit in `idle` rather than in the measured
    increase, which keeps what a step adds: optimizer states, gradients, activations."""
    from tunelab.train.batches import Position
    from tunelab.train.loop import autocast, loss_sum, to_device

    first = source.next(Position())[0][0]
    batch = to_device({k: v for k, v in first.items() if v.dim() > 0}, device)
    with autocast(precision, device):
        loss = loss_sum(model, batch, arch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    del loss, batch


def _time_forward(model, source, arch, precision, device) -> float:  # noqa: ANN001
    """Seconds of one no-grad forward of a micro-batch in eval mode (validation loss)."""
    import torch

    from tunelab.train.batches import Position
    from tunelab.train.loop import validation_loss

    batch = source.next(Position())[0][:1]
    model.eval()
    with torch.no_grad():
        validation_loss(model, batch, arch, precision)  # warm
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        validation_loss(model, batch, arch, precision)
        if device.type == "cuda":
            torch.cuda.synchronize()
    model.train()
    return time.perf_counter() - started


def _forward(model, batch, arch, precision, device, autocast, loss_sum):  # noqa: ANN001
    with autocast(precision, device):
        return loss_sum(model, batch, arch)


# ------------------------------------------------------------------ the parent side


def measure_in_subprocess(
    spec: dict[str, Any], *, timeout_s: float = 1800.0, python: str | None = None
) -> dict[str, Any]:
    """Run one configuration in a fresh `python -m tunelab.sizing.measure` and return its result.

    A child killed by the kernel (SIGKILL: the out-of-memory killer) is reported as does_not_fit;
    an exception in the child, a timeout or a crash without a result as status error, with the
    child's whole error.
    """
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if spec.get("allocator", "pinned") == "pinned":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    with Worker("tunelab.sizing.measure") as worker:
        outcome = worker.run(spec, timeout_s=timeout_s, offline=False, env=env, python=python)
    label = spec.get("label")
    if outcome.result is not None:
        return outcome.result
    if outcome.error is not None:
        error = outcome.error
        return {
            "label": label,
            "status": "error",
            "reason": f"{error['kind']}: {error['message']}",
            "traceback": error.get("traceback"),
        }
    if outcome.timed_out:
        return {"label": label, "status": "error", "reason": f"timeout {timeout_s}s"}
    if outcome.killed:
        return {
            "label": label,
            "status": "does_not_fit",
            "reason": "the process was killed (SIGKILL: most likely the kernel's out-of-memory "
            "killer)",
        }
    return {
        "label": label,
        "status": "error",
        "reason": f"exit {outcome.returncode} without a result: {outcome.stderr.strip()}",
    }


def _measure(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """The worker's body: the result of `run_child` (the watchdog may answer first)."""
    return run_child(spec)


if __name__ == "__main__":
    sys.exit(serve(_measure))
