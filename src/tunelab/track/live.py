"""The step metrics sent to TensorBoard and MLflow while a run trains (`training.log_to`).

`LiveLogger.start(run, names, enabled)` gives each backend a bounded queue drained by its own
background thread: `log(row)` never waits (a full queue drops the row and counts it), a backend
that fails (server down, package missing) is dropped with one warning and training goes on.
`close(error)` stops the threads, waiting at most CLOSE_TIMEOUT_S in all. Only rank 0 logs.

The one hook in training: started before the loop in `tunelab.stages.train.stage`, `log` beside
the metrics.jsonl append of each step, closed after the loop and on any exception. Config:
`training.log_to: list["tensorboard" | "mlflow"]` (default []); TensorBoard files in
`records/runs/<id>/tensorboard/`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from tunelab.track.flatten import step_points
from tunelab.track.optional import TrackingWarning

QUEUE_ROWS = 1000
CLOSE_TIMEOUT_S = 30.0
_CLOSE = object()
# the live MLflow client gives up sooner than MLflow's default of minutes of retries
LIVE_MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _now_ms() -> int:
    return int(time.time() * 1000)


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, run: Any):
        self.run_dir = Path(run.dir)
        self.writer: Any = None

    def open(self) -> None:
        from tunelab.track.tensorboard import TensorBoardWriter

        self.writer = TensorBoardWriter(self.run_dir)

    def send(self, rows: list[dict[str, Any]]) -> None:
        now = _now_ms()
        self.writer.write(p for row in rows for p in step_points(row, now))

    def close(self, error: BaseException | None) -> None:
        self.writer.close()


class MlflowBackend:
    """The run's MLflow run (found by its tunelab run id, or created with its params and tags)
    at MLFLOW_TRACKING_URI, in MLFLOW_EXPERIMENT_NAME or the experiment named after the study."""

    name = "mlflow"

    def __init__(self, run: Any):
        self.run = run
        self.client: Any = None
        self.run_id: str | None = None
        self.skip_through = -1  # steps a resumed run already sent before it stopped
        self._env = contextlib.ExitStack()

    def open(self) -> None:
        from tunelab.track import mlflow_mirror as mm
        from tunelab.track.flatten import describe_study, mirror_run

        study = self.run.study
        target = mm.resolve_target(None)
        self._env.enter_context(mm.quiet_mlflow(target, LIVE_MLFLOW_ENV))
        self.client = mm.open_client(target)
        name = mm.experiment_name(study)
        exp_id = mm.ensure_experiment(self.client, name, target, describe_study(study))
        row = study.ledger.get_run(self.run.id)
        mirror = mirror_run(study, row, [row], [], points=False)
        existing = mm.find_runs(self.client, exp_id).get(self.run.id)
        ml_run, created = mm.open_mlflow_run(self.client, exp_id, mirror, existing, None)
        mm.push_static(self.client, ml_run, mirror, None)
        self.run_id = ml_run.info.run_id
        if not created and "train/loss" in ml_run.data.metrics:
            history = self.client.get_metric_history(self.run_id, "train/loss")
            self.skip_through = max(m.step for m in history)

    def send(self, rows: list[dict[str, Any]]) -> None:
        from tunelab.track.mlflow_mirror import push_points

        now = _now_ms()
        points = [
            p for r in rows if r.get("step", 0) > self.skip_through for p in step_points(r, now)
        ]
        if points:
            push_points(self.client, self.run_id, points)

    def close(self, error: BaseException | None) -> None:
        try:
            self.client.set_terminated(self.run_id, status=mlflow_end_status(error))
        finally:
            self._env.close()


def mlflow_end_status(error: BaseException | None) -> str:
    """FINISHED, KILLED for a signal (KeyboardInterrupt, or an error leaving with exit code
    128 + signal, as a run interrupted by SIGTERM does), else FAILED."""
    if error is None:
        return "FINISHED"
    if isinstance(error, KeyboardInterrupt) or getattr(error, "exit_code", 0) > 128:
        return "KILLED"
    return "FAILED"


class WandbBackend:
    """The run's W&B run (id = the tunelab run id) in WANDB_PROJECT, else the project named
    after the study; WANDB_MODE, WANDB_ENTITY and WANDB_DIR as wandb reads them. At the end
    the last step sent is noted for `tunelab track --wandb`, which then sends only the rest."""

    name = "wandb"

    def __init__(self, run: Any):
        self.run = run
        self.wb_run: Any = None
        self.last_step = -1

    def open(self) -> None:
        import os

        from tunelab.track import wandb_mirror as wm
        from tunelab.track.flatten import mirror_run
        from tunelab.track.optional import import_optional

        wandb = import_optional("wandb", "training.log_to wandb")
        study = self.run.study
        row = study.ledger.get_run(self.run.id)
        mirror = mirror_run(study, row, [row], [], points=False)
        self.project = os.environ.get("WANDB_PROJECT") or study.config.name
        self.wid = wm.wandb_run_id(study.config.name, self.run.id)
        # named here, not left to wandb: it reads WANDB_* once per process
        self.wb_run = wandb.init(
            project=self.project,
            entity=os.environ.get("WANDB_ENTITY"),
            mode=os.environ.get("WANDB_MODE") or "online",
            dir=os.environ.get("WANDB_DIR") or ".",
            id=self.wid,
            name=mirror.name,
            group=row.parent,
            job_type=row.kind,
            config=wm.config(mirror),
            resume="allow",
            reinit="create_new",
            settings=wm._settings(wandb),
        )

    def send(self, rows: list[dict[str, Any]]) -> None:
        from tunelab.track.flatten import RunMirror
        from tunelab.track.wandb_mirror import curve_rows

        points = [p for r in rows for p in step_points(r, _now_ms())]
        held = RunMirror("", "", "", "", None, 0, None, points=points)
        for step, values in curve_rows(held, self.last_step):
            self.wb_run.log(values, step=step)
            self.last_step = step

    def close(self, error: BaseException | None) -> None:
        from tunelab.track.wandb_mirror import SyncState

        code = {"FINISHED": 0, "KILLED": 143}.get(mlflow_end_status(error), 1)
        self.wb_run.finish(exit_code=code)
        state = SyncState(Path(self.wb_run.settings.wandb_dir))
        state.runs[f"{self.project}/{self.wid}"] = {"sha256": "", "step": self.last_step}
        state.save()


BACKENDS = {"tensorboard": TensorBoardBackend, "mlflow": MlflowBackend, "wandb": WandbBackend}


class _Worker:
    """One backend behind a bounded queue and its own thread."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_ROWS)
        self.dropped = 0
        self.problem: str | None = None  # why the backend stopped, until warned about
        self.failed = False
        self.thread = threading.Thread(
            target=self._drain, name=f"tunelab-{backend.name}", daemon=True
        )
        self.thread.start()

    def put(self, row: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(row)
        except queue.Full:
            self.dropped += 1

    def _fail(self, exc: BaseException, doing: str) -> None:
        if not self.failed:
            self.failed = True
            self.problem = f"{doing}: {type(exc).__name__}: {str(exc).strip()[:300]}"

    def _drain(self) -> None:
        try:
            self.backend.open()
        except Exception as exc:  # noqa: BLE001 - any backend failure leaves training alone
            self._fail(exc, "could not start")
        while True:
            batch = [self.queue.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < QUEUE_ROWS:
                    batch.append(self.queue.get_nowait())
            closing = next((b for b in batch if isinstance(b, tuple) and b[0] is _CLOSE), None)
            rows = [b for b in batch if isinstance(b, dict)]
            if rows and not self.failed:
                try:
                    self.backend.send(rows)
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc, "stopped sending")
            if closing is not None:
                if not self.failed:
                    try:
                        self.backend.close(closing[1])
                    except Exception as exc:  # noqa: BLE001
                        self._fail(exc, "could not close")
                return


class LiveLogger:
    """Step rows to the backends named in `training.log_to`; no backend, no thread."""

    def __init__(self, workers: list[_Worker]):
        self.workers = workers

    @classmethod
    def start(cls, run: Any, names: list[str], enabled: bool = True) -> LiveLogger:
        if not enabled or not names:
            return cls([])
        return cls([_Worker(BACKENDS[n](run)) for n in names])

    def log(self, row: dict[str, Any]) -> None:
        """Queue one metrics row for every backend; never blocks."""
        for w in self.workers:
            w.put(dict(row))
        self._warn()

    def __call__(self, state: Any, row: dict[str, Any]) -> None:
        """A step callback of the training loop: `(state, row)`, the row as metrics.jsonl has it."""
        self.log(row)

    def _warn(self) -> None:
        for w in self.workers:
            if w.problem:
                warnings.warn(
                    f"training.log_to {w.backend.name} {w.problem}; training goes on without it "
                    "(the records are complete: `tunelab track` mirrors them later)",
                    TrackingWarning,
                    stacklevel=3,
                )
                w.problem = None

    def close(self, error: BaseException | None = None) -> None:
        """Send what is queued and close each backend; `error` is what stopped the run."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for w in self.workers:
            with contextlib.suppress(queue.Full):
                w.queue.put((_CLOSE, error), timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive() and not w.failed:
                w._fail(TimeoutError(f"no answer within {CLOSE_TIMEOUT_S:g} s"), "did not finish")
            if w.dropped:
                warnings.warn(
                    f"training.log_to {w.backend.name}: {w.dropped} step row(s) were not sent "
                    "(its queue was full)",
                    TrackingWarning,
                    stacklevel=2,
                )
        self._warn()
        self.workers = []
