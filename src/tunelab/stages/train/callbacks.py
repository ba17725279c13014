"""What a training run does after each optimizer step, one named callback per job.

`train_loop` calls a list of callbacks `(state, row) -> None` in order after every step; `row` is
the step's metrics line, which a callback may extend before the next one sees it. A run's list
(`tunelab.stages.train.stage`) is, in this order:

    StepFigures     memory and elapsed time on the row
    UpdateCheck     after `update_check_steps`: the trained tensors moved, the frozen ones did not
    Validation      the validation loss every `eval_every_steps` and at the last step
    MetricsLog      the row appended to metrics.jsonl (rank 0)
    LiveLogger      the row to TensorBoard / MLflow (`training.log_to`, `tunelab.track.live`)
    Checkpoints     a checkpoint every `checkpoint_every_steps` and at the last step
    KillPoint       the test suite's kill after step K
    HeartbeatStep   the heartbeat's step, and a beat after a checkpoint
    ProgressReport  the caller's progress callback (the CLI draws the bar)
    StopOnSignal    SIGINT / SIGTERM: a checkpoint, then RunInterrupted

Adding a job is one more entry in that list. The heartbeat thread and the signal handler that
these callbacks consult (`Heartbeat`, `SignalStop`) live here too.

A run's step callbacks, in order: `StepFigures` (memory_bytes, elapsed_s), `UpdateCheck`,
`Validation`, `MetricsLog`, `tunelab.track.live.LiveLogger` (`training.log_to`), `Checkpoints`,
`kill_point`, `HeartbeatStep`, `ProgressReport`, `StopOnSignal`. The list is built in
`tunelab.stages.train.stage`; a new job is one more entry. `Heartbeat`, `SignalStop` and
`RunInterrupted` live here too. Test hook: `TUNELAB_TEST_KILL_AT=step:K | save:K | term:K`
(SIGKILL after step K, SIGKILL in the middle of writing checkpoint K, SIGTERM after step K);
tests only.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tunelab.core.errors import RunError
from tunelab.core.ledger import utc_now
from tunelab.core.progress import Progress
from tunelab.core.records import append_jsonl, write_json_atomic
from tunelab.core.study import Run
from tunelab.stages.train import checkpoint as ckpt
from tunelab.stages.train.loop import InvalidRun, Loop, TrainState, validation_loss
from tunelab.stages.train.strategy import Strategy

HEARTBEAT_EVERY_S = 5.0


class RunInterrupted(RunError):
    """SIGINT or SIGTERM: a checkpoint was saved and the process stops (exit 128 + signal)."""

    def __init__(self, message: str, hint: str | None = None, signum: int = signal.SIGTERM):
        super().__init__(message, hint)
        self.exit_code = 128 + int(signum)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Clock:
    """Seconds of training, across the attempts of a resumed run."""

    def __init__(self, elapsed_before: float = 0.0):
        self.elapsed_before = elapsed_before
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started


# ------------------------------------------------------------------ the callbacks


class StepFigures:
    """The row's `memory_bytes` (peak so far) and `elapsed_s` (training time of the run)."""

    def __init__(self, device: torch.device, clock: Clock):
        self.device, self.clock = device, clock

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        row["memory_bytes"] = peak_memory_bytes(self.device)
        row["elapsed_s"] = self.clock.elapsed()


class UpdateCheck:
    """After step `after_step`: the tensors that train moved and the frozen ones did not;
    a violation makes the run invalid. `record` is what the ledger's update_check event holds."""

    def __init__(self, model: torch.nn.Module, method: str, after_step: int, start_step: int):
        from tunelab.lib.models import capture_params

        self.model, self.method, self.after_step = model, method, after_step
        self.before = capture_params(model) if start_step < after_step else None
        self.record: dict[str, Any] = {"after_step": after_step, "violations": None}
        if self.before is None:
            self.record["note"] = "resumed after the check step; checked in the first attempt"

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        if self.before is None or state.step != self.after_step:
            return
        from tunelab.lib.models import classify_update

        result = classify_update(self.before, self.model, state.step, self.method)
        self.before.release()
        violations = result.violations
        self.record["violations"] = violations
        if result.unused:
            # trainable in name only: the task's forward never reads them
            self.record["unused"] = result.unused
            self.record["unused_parameters"] = result.unused_numel
        if result.unrouted:
            self.record["unrouted_experts"] = result.unrouted
        if violations:
            raise InvalidRun(
                f"update check after step {state.step}: {len(violations)} tensor(s) wrong: "
                + "; ".join(violations[:5]),
                hint="check adaptation (targets, frozen modules) and training.lr",
            )

    @property
    def passed(self) -> bool:
        return self.record["violations"] in ([], None)


class Validation:
    """The validation loss every `every` steps and at the last one (`row["val_loss"]`). Every
    rank evaluates the whole split (an FSDP forward is collective): no reduction."""

    def __init__(self, loop: Loop, batches: list[dict[str, torch.Tensor]], every: int | None):
        self.loop, self.batches, self.every = loop, batches, every
        self.initial: float | None = None
        self.last: float | None = None

    def loss(self) -> tuple[float, int]:
        return validation_loss(
            self.loop.model, self.batches, self.loop.architecture, self.loop.cfg.precision
        )

    def before_training(self, state: TrainState, run: Run, strategy: Strategy) -> None:
        """The `step: 0` line: the validation loss of the model before its first step."""
        if not self.batches or state.step != 0:
            return
        self.initial, n = self.loss()
        if strategy.is_main:
            append_jsonl(
                run.path("metrics.jsonl"), {"step": 0, "val_loss": self.initial, "val_tokens": n}
            )

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        due = self.every and state.step % self.every == 0
        if self.batches and (due or state.step == self.loop.total_steps):
            row["val_loss"], row["val_tokens"] = self.loss()
            self.last = row["val_loss"]


class MetricsLog:
    """The row, one line of metrics.jsonl per step (rank 0 writes)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        if self.enabled:
            append_jsonl(self.path, row)


class CheckpointSaver:
    """Writes the run's checkpoint of a state (every rank calls it) and prunes old ones."""

    def __init__(
        self,
        root: Path,
        loop: Loop,
        *,
        method: str,
        identity: dict[str, Any],
        keep_last: int,
        clock: Clock,
        shards_at: Callable[[int], str] | None = None,
    ):
        self.root, self.loop, self.method = root, loop, method
        self.identity, self.keep_last, self.clock = identity, keep_last, clock
        self.shards_at = shards_at  # step -> the shard store's location (several nodes)

    def save(self, state: TrainState) -> Path:
        loop = self.loop
        path = ckpt.save_checkpoint(
            self.root,
            state.step,
            model=loop.model,
            optimizer=loop.optimizer,
            scheduler=loop.scheduler,
            scaler=loop.scaler,
            method=self.method,
            strategy=loop.strategy,
            shards_at=self.shards_at(state.step) if self.shards_at else None,
            state={
                **self.identity,
                "position": state.position.to_dict(),
                "epoch": loop.source.order.epoch_float(state.position),
                "tokens_seen": state.tokens_seen,
                "loss_tokens_seen": state.loss_tokens_seen,
                "last_loss": state.last_loss,
                "total_steps": loop.total_steps,
                "elapsed_s": self.clock.elapsed(),
            },
        )
        if loop.strategy.is_main:
            ckpt.prune_checkpoints(self.root, self.keep_last)
        return path


class Checkpoints:
    """A checkpoint every `every` steps and at the last step; `saved_step` is the last saved."""

    def __init__(self, saver: CheckpointSaver, every: int | None):
        self.saver, self.every = saver, every
        self.saved_step: int | None = None

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        due = self.every and state.step % self.every == 0
        if state.step == self.saver.loop.total_steps or due:
            self.saver.save(state)
            self.saved_step = state.step


def kill_point(state: TrainState, row: dict[str, Any]) -> None:
    """The test suite's signal after step K (`TUNELAB_TEST_KILL_AT`)."""
    ckpt.kill_for_test("step", state.step)


class HeartbeatStep:
    """Tells the heartbeat the step reached, and beats at once after a checkpoint."""

    def __init__(self, beat: Heartbeat, checkpoints: Checkpoints):
        self.beat, self.checkpoints = beat, checkpoints

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        self.beat.step = state.step
        if self.checkpoints.saved_step == state.step:
            self.beat.beat()


def progress_text(row: dict[str, Any], rate: str = "tok/s") -> str:
    """'loss 6.2500 | 2,140 tok/s': a step's figures beside its bar (`rate`: the unit of the
    row's `tokens_per_s`, `img/s` for an image task, whose batches count images)."""
    tps, loss = row.get("tokens_per_s"), row.get("loss")
    text = f"loss {loss:.4f}" if loss is not None else ""
    return text + (f" | {tps:,.0f} {rate}" if tps else "")


class ProgressReport:
    """The caller's progress callback (core.progress), on rank 0: ("train", step, total
    steps, the step's loss and rate)."""

    def __init__(self, progress: Progress, total: int, images: bool = False):
        self.progress, self.total = progress, total
        self.rate = "img/s" if images else "tok/s"

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        self.progress("train", state.step, self.total, progress_text(row, self.rate))


class StopOnSignal:
    """A SIGINT / SIGTERM seen by any rank stops every rank after the same step (their
    checkpoint save is collective): a checkpoint, then RunInterrupted."""

    def __init__(self, stop: SignalStop, saver: CheckpointSaver, run_id: str):
        self.stop, self.saver, self.run_id = stop, saver, run_id

    def __call__(self, state: TrainState, row: dict[str, Any]) -> None:
        strategy = self.saver.loop.strategy
        signum = self.stop.signum
        if strategy.all_reduce_sum(1.0 if signum is not None else 0.0) > 0:
            signum = signum if signum is not None else int(signal.SIGTERM)
        if signum is None or state.step >= self.saver.loop.total_steps:
            return
        path = self.saver.save(state)
        name = signal.Signals(signum).name
        raise RunInterrupted(
            f"run {self.run_id} stopped by {name} after step {state.step}; checkpoint "
            f"{path.name} saved",
            hint=f"`tunelab resume {self.run_id}` continues it to the same result",
            signum=signum,
        )


# ------------------------------------------------------------------ what the callbacks consult


class SignalStop:
    """Turns the first SIGINT/SIGTERM into a flag the loop checks after each step; a second
    one interrupts at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> SignalStop:
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: signals stay with the caller
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Heartbeat:
    """Says the run is alive every HEARTBEAT_EVERY_S from a background thread (ledger and
    status.json, with the current step), so a slow step, a long evaluation or a big checkpoint
    never looks like a dead process to `Study.reconcile`. Stopped before the final status."""

    def __init__(self, run: Run, enabled: bool = True):
        self.run = run
        self.enabled = enabled
        self.step = 0
        self.total_steps: int | None = None
        self.reason = run.row.reason if enabled else None  # e.g. "resumed from step-000003"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tunelab-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self.beat()
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY_S):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a missed beat (busy disk, locked ledger) is retried
                pass

    def beat(self) -> None:
        with self._lock:
            if self._stop.is_set() or not self.enabled:
                return
            now = utc_now()
            self.run.heartbeat()
            write_json_atomic(
                self.run.path("status.json"),
                {
                    "run_id": self.run.id,
                    "status": "running",
                    "reason": self.reason,
                    "at": now,
                    "heartbeat_at": now,
                    "pid": os.getpid(),
                    "step": self.step,
                    "total_steps": self.total_steps,
                },
                overwrite=True,
            )
