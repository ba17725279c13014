"""The measuring processes, from the parent: `python -m tunelab.stages.sizing.measure SPEC` children.

`measure_configurations(specs, shared=True)` gives every configuration to one child, which
measures them in turn (imports and the model's conversion paid once, the model rebuilt for
each, its memory given back in between: `measure.settle`). A child stopped on the way (the
watchdog past the budget, the kernel's out-of-memory killer, a crash, the timeout) leaves the
results it wrote; the configuration it was on gets the verdict of its end and the rest go to a
new child. `shared=False` starts a fresh child for every configuration (`tunelab size
--fresh-processes`), as does glibc's default allocator (`--allocator default`), whose moving
thresholds make a configuration's RSS depend on what ran before it in the process.

`measure_configurations(specs, timeout_s=, shared=True, on_result=) -> [result]` (each result
has `process {index, position}`) and `measure_in_subprocess(spec, timeout_s=) -> result` turn an
exception in the child, a crash or a timeout into a row of status error with the child's whole
error, a SIGKILL into does_not_fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunelab.core.record_sizing import WRITING, MeasurePhase, SizingResult
from tunelab.core.worker import Outcome, Worker
from tunelab.stages.sizing.measure import result_path, specs_of
from tunelab.stages.sizing.process_memory import MMAP_THRESHOLD

OnResult = Callable[[int, dict[str, Any]], None]


def measure_in_subprocess(
    spec: dict[str, Any], *, timeout_s: float = 1800.0, python: str | None = None
) -> dict[str, Any]:
    """Run one configuration in a fresh `python -m tunelab.stages.sizing.measure` and return its result.

    A child killed by the kernel (SIGKILL: the out-of-memory killer) is reported as does_not_fit;
    an exception in the child, a timeout or a crash without a result as status error, with the
    child's whole error.
    """
    return measure_configurations([spec], timeout_s=timeout_s, shared=False, python=python)[0]


def measure_configurations(
    specs: list[dict[str, Any]],
    *,
    timeout_s: float = 1800.0,
    shared: bool = True,
    on_result: OnResult | None = None,
    python: str | None = None,
) -> list[dict[str, Any]]:
    """Every spec's result, in order; `on_result(index, result)` as each becomes known (not
    necessarily in order). `timeout_s` is per configuration. Each result carries `process`
    {index, position}: which child measured it, and its place among that child's specs."""
    shared = shared and all(s.pinned for s in specs_of(specs, WRITING))
    # one process makes the optimizer's states without a warm-up step; fresh ones run one
    specs = [{"warmup": "states" if shared else "step", **s} for s in specs]
    results: dict[int, dict[str, Any]] = {}
    pending = list(range(len(specs)))
    child = 0
    while pending:
        group = pending if shared else pending[:1]

        def seen(j: int, result: dict[str, Any], group: list[int] = group, child: int = child):
            result["process"] = {"index": child, "position": j}
            results[group[j]] = result
            if on_result is not None:
                on_result(group[j], result)

        _run_child([specs[i] for i in group], timeout_s * len(group), seen, python)
        pending = [i for i in pending if i not in results]
        child += 1
    return [results[i] for i in range(len(specs))]


def _run_child(
    specs: list[dict[str, Any]], timeout_s: float, seen: OnResult, python: str | None
) -> None:
    """Measure `specs` in one child; `seen(j, result)` for each result it gives: the whole one
    (`configuration-<j>.json`), or the memory phase's where that is final (does not fit, an
    error), and for the configuration it was on when it ended early, the verdict of its end.
    Configurations it did not reach or finish are left for the caller to give to a new child."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    typed = specs_of(specs, WRITING)
    if typed[0].pinned:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    done: set[int] = set()

    def collect() -> None:
        for j in range(len(specs)):
            if j not in done:
                result = _final(worker.dir, j)
                if result is not None:
                    done.add(j)
                    seen(j, result)

    with Worker("tunelab.stages.sizing.measure") as worker:
        outcome = worker.run(
            {"configurations": specs},
            timeout_s=timeout_s,
            offline=False,
            env=env,
            python=python,
            poll=collect,
        )
        collect()
        phase = worker.dir / "phase.json"
        at = MeasurePhase.read(phase).index if phase.exists() else 0
    if at not in done and not (outcome.returncode == 0 and outcome.result):
        done.add(at)
        seen(at, _ended(outcome, typed[at].label, timeout_s))


def _final(folder: Any, j: int) -> dict[str, Any] | None:
    """The child's result of configuration `j`, checked as its kind: the whole one, or the
    memory phase's where that is final (None while neither is known)."""
    whole = result_path(folder, j)
    if whole.exists():
        return SizingResult.read(whole).raw
    memory = result_path(folder, j, "memory")
    if memory.exists():
        result = SizingResult.read(memory)
        return result.raw if result.status != "ok" else None
    return None


def _ended(outcome: Outcome, label: Any, timeout_s: float) -> dict[str, Any]:
    """The verdict for the configuration a child was measuring when it ended without its result:
    SIGKILL (the kernel's out-of-memory killer) is does_not_fit; an exception outside the
    measurements, a timeout or a crash is an error with the child's whole error."""
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
