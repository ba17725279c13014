"""`sync_mlflow(study, uri)`: the study as one MLflow experiment, one MLflow run per tunelab run.

The tunelab run id is the key: it is a tag of the MLflow run (`tunelab.run_id`), searched
before any run is created, so syncing again updates the runs it finds and never duplicates
them. A run whose mirror did not change since the last sync (the `tunelab.sync_sha256` tag) is
left alone; one that changed gets its new status, tags and files, the params it lacks and only
the metric values whose steps MLflow does not hold yet.

`sync_mlflow(study, uri=None, *, experiment=None, progress=None) -> {uri, kind, experiment {name,
id}, runs [{run_id, kind, name, status, reason, mlflow_run_id, action (created | updated |
unchanged), params, metrics, files}], counts}`; `progress("track", done, total, run_id)` (core.progress).
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.hashing import sha256_file, sha256_json
from tunelab.core.progress import Progress
from tunelab.track.flatten import RunMirror, action_counts, collect_study, run_result
from tunelab.track.optional import TrackingError, import_optional, mlflow_client_class

if TYPE_CHECKING:
    from tunelab.core.study import Study

STATUS = {
    "running": "RUNNING",
    "completed": "FINISHED",
    "failed": "FAILED",
    "invalid": "FAILED",
    "interrupted": "KILLED",
}
KEY_TAG = "tunelab.run_id"
SYNC_TAG = "tunelab.sync_sha256"
FILES_TAG = "tunelab.files_sha256"
HEALTH_TIMEOUT_S = 5.0
URI_HINT = (
    "pass --mlflow with a folder (./mlruns, which holds the SQLite store mlruns/mlflow.db), "
    "a SQLite file (sqlite:///mlflow.db) or a server (http://127.0.0.1:5000), or set "
    "MLFLOW_TRACKING_URI"
)


@dataclass(frozen=True)
class Target:
    """Where the mirror goes: `uri` as MLflow takes it, `kind` sqlite | folder (MLflow's
    folder store, found in place) | http | other."""

    uri: str
    kind: str

    @property
    def artifact_location(self) -> str | None:
        """Artifacts of an experiment tunelab creates in a SQLite store go beside the database
        (MLflow's default is ./mlruns under whatever folder the command ran in)."""
        if self.kind != "sqlite":
            return None
        db = Path(self.uri.removeprefix("sqlite:///"))
        return (db.parent / "mlartifacts").resolve().as_uri()


DB_NAME = "mlflow.db"


def is_file_store(folder: Path) -> bool:
    """Whether `folder` holds MLflow's folder store (an experiment folder with its meta.yaml,
    or the `.trash` folder MLflow makes beside them)."""
    return (folder / ".trash").is_dir() or any(folder.glob("*/meta.yaml"))


def resolve_target(uri: str | None) -> Target:
    """The tracking URI from `uri`, else MLFLOW_TRACKING_URI; raises TrackingError when neither
    names one. A plain path is a folder: the SQLite store `<folder>/mlflow.db` (what MLflow
    opens without any setting), or MLflow's folder store when the folder already holds one."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or None
    if not uri:
        raise TrackingError("no MLflow tracking URI given", hint=URI_HINT)
    if uri.startswith(("http://", "https://")):
        return Target(uri.rstrip("/"), "http")
    if uri.startswith("sqlite:///"):
        return _sqlite_target(Path(uri.removeprefix("sqlite:///")), uri)
    if uri.startswith("file:"):
        uri = uri.removeprefix("file://").removeprefix("file:")
    elif "://" in uri:
        return Target(uri, "other")
    path = Path(uri).expanduser()
    if path.exists() and not path.is_dir():
        raise TrackingError(
            f"{path} is a file, not an MLflow folder",
            hint="name a folder (it is created), or sqlite:///FILE.db",
        )
    if path.is_dir() and is_file_store(path):
        return Target(str(path.resolve()), "folder")
    return _sqlite_target(path / DB_NAME, uri)


def _sqlite_target(path: Path, uri: str) -> Target:
    if path.is_dir():
        raise TrackingError(
            f"{uri}: {path} is a folder, not a SQLite file",
            hint=f"name a file, e.g. sqlite:///{DB_NAME}",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return Target(f"sqlite:///{path.resolve()}", "sqlite")


def check_reachable(target: Target, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Ask a server's /health once, so that a server that is down fails in seconds (MLflow's
    own client retries for minutes)."""
    if target.kind != "http":
        return
    try:
        with urllib.request.urlopen(f"{target.uri}/health", timeout=timeout_s) as reply:
            reply.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackingError(
            f"the MLflow server at {target.uri} did not answer ({reason})",
            hint="start it (`mlflow server --host 127.0.0.1 --port 5000`) or check the URI",
        ) from None


@contextlib.contextmanager
def quiet_mlflow(target: Target, env: dict[str, str] | None = None) -> Iterator[None]:
    """MLflow's settings for a mirror: its file store allowed when the folder named holds one
    (MLflow keeps it in maintenance mode behind MLFLOW_ALLOW_FILE_STORE), no run URLs printed on
    stdout, its INFO logs (database migrations) kept off the terminal; `env` adds settings.
    A variable the user set keeps the user's value."""
    wanted = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true", **(env or {})}
    if target.kind == "folder":
        wanted["MLFLOW_ALLOW_FILE_STORE"] = "true"
    saved = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    mlflow_client_class()  # MLflow sets its loggers' levels when it is imported
    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def open_client(target: Target) -> Any:
    """An MlflowClient on `target` (raises TrackingError without the extra or the server)."""
    cls = mlflow_client_class()
    check_reachable(target)
    return cls(tracking_uri=target.uri)


def ensure_experiment(client: Any, name: str, target: Target, description: str) -> str:
    """The id of the experiment `name`, created (or restored from MLflow's trash) if needed."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(
            name,
            artifact_location=target.artifact_location,
            tags={"mlflow.note.content": description, "tunelab.core.study": name},
        )
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    client.set_experiment_tag(exp.experiment_id, "mlflow.note.content", description)
    return exp.experiment_id


def experiment_name(study: Study, name: str | None = None) -> str:
    """`name`, else MLFLOW_EXPERIMENT_NAME, else the study's name."""
    return name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or study.config.name


def find_runs(client: Any, experiment_id: str) -> dict[str, Any]:
    """The experiment's MLflow runs by their `tunelab.run_id` tag."""
    found: dict[str, Any] = {}
    token = None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{KEY_TAG}` LIKE '%'",
            max_results=1000,
            page_token=token,
        )
        for run in page:
            found.setdefault(run.data.tags[KEY_TAG], run)
        token = page.token
        if not token:
            return found


# ------------------------------------------------------------------ one run


def _limits() -> dict[str, int]:
    v = import_optional("mlflow.utils.validation", "mirroring to MLflow")
    return {
        "param": v.MAX_PARAM_VAL_LENGTH,
        "tag": v.MAX_TAG_VAL_LENGTH,
        "metrics": v.MAX_METRICS_PER_BATCH,
        "params_tags": v.MAX_PARAMS_TAGS_PER_BATCH,
    }


def _clip(value: str, limit: int) -> str:
    marker = " ... (clipped; the whole value is in the run's records)"
    return value if len(value) <= limit else value[: limit - len(marker)] + marker


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def files_sha256(mirror: RunMirror) -> str:
    return sha256_json([[str(f), folder, sha256_file(f)] for f, folder in mirror.files])


def open_mlflow_run(
    client: Any, experiment_id: str, mirror: RunMirror, existing: Any, parent_id: str | None
) -> tuple[Any, bool]:
    """The MLflow run of `mirror`: `existing` (found by its tag) or a new one with the key tag
    set at creation. Returns (run, created)."""
    if existing is not None:
        return existing, False
    tags = {KEY_TAG: mirror.run_id}
    if parent_id:
        tags["mlflow.parentRunId"] = parent_id
    run = client.create_run(
        experiment_id, start_time=mirror.start_ms, tags=tags, run_name=mirror.name
    )
    return run, True


def push_static(client: Any, run: Any, mirror: RunMirror, parent_id: str | None) -> int:
    """Params the MLflow run lacks, every tag, the name and the status. Returns the number of
    params sent (a param MLflow holds is immutable and never sent again)."""
    from mlflow.entities import Param, RunTag

    lim = _limits()
    held = run.data.params
    params = [Param(k, _clip(v, lim["param"])) for k, v in mirror.params.items() if k not in held]
    tags = {**mirror.tags}
    if parent_id:
        tags["mlflow.parentRunId"] = parent_id
    tag_list = [RunTag(k, _clip(v, lim["tag"])) for k, v in tags.items()]
    rid = run.info.run_id
    for chunk in _chunks(params, lim["params_tags"]):
        client.log_batch(rid, params=list(chunk))
    for chunk in _chunks(tag_list, lim["params_tags"]):
        client.log_batch(rid, tags=list(chunk))
    for key in set(run.data.tags) - set(tags) - {KEY_TAG, SYNC_TAG, FILES_TAG}:
        if key.startswith("tunelab."):  # a value the records no longer hold (a cleared reason)
            client.delete_tag(rid, key)
    if run.info.run_name != mirror.name:
        client.update_run(rid, name=mirror.name)
    status = STATUS.get(mirror.status, "RUNNING")
    if status == "RUNNING":
        client.update_run(rid, status=status)
    elif run.info.status != status or run.info.end_time != mirror.end_ms:
        client.set_terminated(rid, status=status, end_time=mirror.end_ms)
    return len(params)


def missing_points(client: Any, run: Any, points: list[Any]) -> list[Any]:
    """The points whose (key, step) MLflow does not hold yet; histories are read only for the
    keys the run already has."""
    held: dict[str, set[int]] = {}
    for key in {p.key for p in points} & set(run.data.metrics):
        held[key] = {m.step for m in client.get_metric_history(run.info.run_id, key)}
    return [p for p in points if p.step not in held.get(p.key, ())]


def push_points(client: Any, run_id: str, points: list[Any]) -> None:
    from mlflow.entities import Metric

    metrics = [Metric(p.key, p.value, p.timestamp_ms, p.step) for p in points]
    for chunk in _chunks(metrics, _limits()["metrics"]):
        client.log_batch(run_id, metrics=list(chunk))


def push_files(client: Any, run: Any, mirror: RunMirror) -> int:
    """Upload the run's record files when any changed since the last upload (the files tag)."""
    digest = files_sha256(mirror)
    if run.data.tags.get(FILES_TAG) == digest:
        return 0
    for path, folder in mirror.files:
        client.log_artifact(run.info.run_id, str(path), folder)
    client.set_tag(run.info.run_id, FILES_TAG, digest)
    return len(mirror.files)


def sync_run(
    client: Any, experiment_id: str, mirror: RunMirror, existing: Any, parent_id: str | None
) -> dict[str, Any]:
    """Create or update one MLflow run from its mirror; the sync tag is set last, so a sync
    that stopped half-way is completed by the next one."""
    fingerprint = mirror.fingerprint()
    if existing is not None and existing.data.tags.get(SYNC_TAG) == fingerprint:
        return {
            "mlflow_run_id": existing.info.run_id,
            "action": "unchanged",
            "params": 0,
            "metrics": 0,
            "files": 0,
        }
    run, created = open_mlflow_run(client, experiment_id, mirror, existing, parent_id)
    params = push_static(client, run, mirror, parent_id)
    points = mirror.points if created else missing_points(client, run, mirror.points)
    push_points(client, run.info.run_id, points)
    files = push_files(client, run, mirror)
    client.set_tag(run.info.run_id, SYNC_TAG, fingerprint)
    return {
        "mlflow_run_id": run.info.run_id,
        "action": "created" if created else "updated",
        "params": params,
        "metrics": len(points),
        "files": files,
    }


# ------------------------------------------------------------------ the study


def sync_mlflow(
    study: Study,
    uri: str | None = None,
    *,
    experiment: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Mirror every run of `study` into the MLflow experiment `experiment` (default:
    MLFLOW_EXPERIMENT_NAME, else the study's name) at `uri` (default: MLFLOW_TRACKING_URI).

    Returns {uri, kind, experiment: {name, id}, runs: [{run_id, kind, name, status, reason,
    mlflow_run_id, action (created | updated | unchanged), params, metrics, files}], counts}.
    Raises TrackingError when no URI is given, the server does not answer or the `tracking`
    extra is missing.
    """
    from tunelab.track.flatten import describe_study

    target = resolve_target(uri)
    name = experiment_name(study, experiment)
    mirrors = collect_study(study)
    with quiet_mlflow(target), _as_tracking_error(target):
        client = open_client(target)
        exp_id = ensure_experiment(client, name, target, describe_study(study))
        existing = find_runs(client, exp_id)
        mlflow_ids: dict[str, str] = {}
        results = []
        for i, mirror in enumerate(mirrors):
            if progress is not None:
                progress("track", i, len(mirrors), mirror.run_id)
            parent = mlflow_ids.get(mirror.nest_under) if mirror.nest_under else None
            result = sync_run(client, exp_id, mirror, existing.get(mirror.run_id), parent)
            mlflow_ids[mirror.run_id] = result["mlflow_run_id"]
            results.append(run_result(mirror, result))
        if progress is not None:
            progress("track", len(mirrors), len(mirrors))
    counts = action_counts(results)
    return {
        "uri": target.uri,
        "kind": target.kind,
        "experiment": {"name": name, "id": exp_id},
        "runs": results,
        "counts": counts,
    }


@contextlib.contextmanager
def _as_tracking_error(target: Target) -> Iterator[None]:
    """MLflow's own failures (a refused value, a store it cannot open, a server error) as a
    TrackingError naming the URI."""
    try:
        yield
    except TrackingError:
        raise
    except Exception as exc:
        mlflow_exc = import_optional("mlflow.exceptions", "mirroring to MLflow").MlflowException
        requests_exc = import_optional("requests", "mirroring to MLflow").RequestException
        if not isinstance(exc, mlflow_exc | requests_exc | OSError):
            raise
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackingError(
            f"MLflow at {target.uri} refused the mirror: {text[:500]}",
            hint="check the URI and that the server runs the same MLflow major version",
        ) from exc
