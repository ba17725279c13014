"""tunelab track: a real study (tiny BERT: baseline, a trained and evaluated LoRA run, a failed
run, an interrupted run, a comparison and the dossier) mirrored into MLflow's folder store, a
SQLite store and a server over HTTP, read back with MlflowClient; TensorBoard event files and
live MLflow metrics written while training, read back with the trackers' own readers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers import register_study, run_cli, train_stopped_at, write_topic_study
from tunelab.core.errors import ConfigError
from tunelab.core.records import read_jsonl
from tunelab.core.study import Study
from tunelab.track.flatten import STUDY_RUN_ID, flatten_params, metric_key, step_points
from tunelab.track.mlflow_mirror import SYNC_TAG, is_file_store, sync_mlflow
from tunelab.track.optional import INSTALL_HINT, TrackingError, TrackingWarning, import_optional

STEPS = 6
NAME = "track-test"
MIRRORS = 7  # baseline, lora, its evaluation, the failed, invalid and stopped runs; the study


@pytest.fixture(autouse=True)
def quiet_mlflow(monkeypatch, one_thread):
    """MLflow without its printed URL and without a tracking server from the environment."""
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, tiny_bert_dir) -> Path:
    """register -> data -> baseline -> train (TensorBoard live) -> eval, a failed run, an
    invalid run (a learning rate too small to move a weight), a run stopped by SIGTERM after
    step 3, compare, report."""
    from tunelab.stages.compare import stage as compare_stage
    from tunelab.stages.compare.stage import save_compare
    from tunelab.stages.evaluate import stage as evaluate_stage
    from tunelab.stages.report import stage as report_stage
    from tunelab.stages.train import InvalidRun
    from tunelab.stages.train import stage as train_stage

    torch.set_num_threads(1)
    root = write_topic_study(
        tmp_path_factory.mktemp("track") / "s",
        tiny_bert_dir,
        NAME,
        max_steps=STEPS,
        training={"eval_every_steps": 2, "log_to": ["tensorboard"], "num_threads": 1},
    )
    study = register_study(root)
    evaluate_stage.run(study)
    lora = train_stage.run(study, name="lora", why="LoRA r8 on query and value")
    evaluate_stage.run(study, lora.id)
    broken = Study.open(root, ["training.optimizer=NoSuchOptimizer"])
    with pytest.raises(ConfigError):
        train_stage.run(broken, name="no-such-optimizer", parent=lora.id, why="an optimizer typo")
    with pytest.raises(InvalidRun):
        train_stage.run(Study.open(root, ["training.lr=1e-30"]), name="frozen", why="lr 1e-30")
    train_stopped_at(study, 3, "stopped", why="stopped by SIGTERM")
    save_compare(study, compare_stage.run(study))
    report_stage.run(study)
    return root


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    """One SQLite store for the file (its tables take seconds to create); each test mirrors
    into an experiment of its own."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client_for(uri).search_experiments()
    return uri


def runs_by_kind_name(study: Study) -> dict[str, str]:
    return {row.name: row.id for row in study.list_runs()}


def client_for(uri: str):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def mlflow_runs(client, name: str = NAME) -> dict[str, object]:
    exp = client.get_experiment_by_name(name)
    return {r.data.tags["tunelab.run_id"]: r for r in client.search_runs([exp.experiment_id])}


def history(client, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def artifacts(client, run, folder: str) -> set[str]:
    return {Path(f.path).name for f in client.list_artifacts(run.info.run_id, folder)}


# ------------------------------------------------------------------ pure flattening


def test_flatten_params_points_and_keys():
    params = flatten_params(
        {
            "training": {"lr": 2e-4, "betas": [0.9, 0.999], "grad_clip": None, "packing": True},
            "task": {"json_schema": {}, "labels": ["a b", "c"]},
            "name": "x",
        }
    )
    assert params == {
        "training.lr": "0.0002",
        "training.betas": "[0.9, 0.999]",
        "training.grad_clip": "null",
        "training.packing": "true",
        "task.json_schema": "{}",
        "task.labels": '["a b", "c"]',
        "name": "x",
    }
    points = step_points({"step": 4, "loss": 1.5, "val_loss": 1.2, "lr": 1e-3, "note": "x"}, 7)
    assert {(p.key, p.value, p.step, p.timestamp_ms) for p in points} == {
        ("train/loss", 1.5, 4, 7),
        ("validation/loss", 1.2, 4, 7),
        ("train/lr", 1e-3, 4, 7),
    }
    assert metric_key("validation", "per_category", "sci/tech+", "f1") == (
        "validation/per_category/sci/tech_/f1"
    )


def test_tags_name_a_hub_base_by_its_commit():
    from types import SimpleNamespace

    from tunelab.core.record_types import RunConfig
    from tunelab.track.flatten import run_tags

    row = SimpleNamespace(
        id="train-x",
        kind="train",
        name=None,
        parent=None,
        why=None,
        status="failed",
        reason="out of memory",
        created_at="2026-01-01T00:00:00Z",
        finished_at=None,
    )
    base = {
        "name": "org/model",
        "revision": "main",
        "sha256": "ab" * 32,
        "source": {"hub": {"repo_id": "org/model", "revision": "main", "commit": "c0ffee"}},
    }
    record = {"run_id": "train-x", "kind": "train", "config": {}, "config_sha256": "cd" * 32}
    tags = run_tags(RunConfig.of("config.json", record | {"base_model": base}), row, None)
    assert tags["tunelab.base.commit"] == "c0ffee" and tags["tunelab.base.repo_id"] == "org/model"
    assert tags["tunelab.reason"] == "out of memory" and "tunelab.why" not in tags
    assert "**Status:** failed: out of memory" in tags["mlflow.note.content"]


def test_a_half_written_last_line_waits_only_while_the_run_runs(tmp_path):
    from tunelab.core.errors import StudyError
    from tunelab.track.flatten import step_rows

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert step_rows(path, running=True) == [{"step": 1, "loss": 2.0}]
    with pytest.raises(StudyError, match="metrics.jsonl:2: not valid JSON"):
        step_rows(path, running=False)


def test_a_live_mlflow_run_ends_with_the_runs_outcome():
    from tunelab.stages.train import RunFailed, RunInterrupted
    from tunelab.track.live import mlflow_end_status

    assert mlflow_end_status(None) == "FINISHED"
    assert mlflow_end_status(RunInterrupted("stopped", signum=signal.SIGTERM)) == "KILLED"
    assert mlflow_end_status(KeyboardInterrupt()) == "KILLED"
    assert mlflow_end_status(RunFailed("out of memory")) == "FAILED"
    assert mlflow_end_status(ConfigError("bad optimizer")) == "FAILED"


def test_log_to_names_only_known_backends(tmp_path, tiny_bert_dir):
    root = write_topic_study(tmp_path / "s", tiny_bert_dir, NAME, training={"log_to": ["neptune"]})
    with pytest.raises(ConfigError) as err:
        Study.open(root)
    assert "training.log_to" in err.value.message and "'mlflow' or 'wandb'" in (err.value.message)
    with pytest.raises(ConfigError, match="twice"):
        Study.open(root, ["training.log_to=[mlflow, mlflow]"])


def test_the_trackers_are_imported_only_when_used():
    code = (
        "import sys, tunelab.cli, tunelab.cli.track, tunelab.track.live, "
        "tunelab.track.mlflow_mirror, tunelab.track.tensorboard, tunelab.track.wandb_mirror\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlflow', 'tensorboard', 'wandb')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(TrackingError) as err:
        import_optional("mlflow.tracking", "mirroring to MLflow")
    assert err.value.hint == INSTALL_HINT and "tunelab[tracking]" in INSTALL_HINT


# ------------------------------------------------------------------ the mirror read back


def file_store(folder: Path) -> str:
    """MLflow's folder store made by MLflow itself (one experiment in it), as a user who
    mirrored with an older tunelab has one."""
    code = (
        "import sys; from mlflow.tracking import MlflowClient; "
        "MlflowClient(sys.argv[1]).create_experiment('older')"
    )
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder)], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["file-store", "sqlite"])
def test_sync_reads_back_with_mlflow_client(study_dir, tmp_path, sqlite_uri, store):
    uri = file_store(tmp_path / "mlruns") if store == "file-store" else sqlite_uri
    study = Study.open(study_dir)
    names = runs_by_kind_name(study)
    result = sync_mlflow(study, uri)
    assert result["counts"] == {"created": MIRRORS, "updated": 0, "unchanged": 0}
    assert result["kind"] == ("folder" if store == "file-store" else "sqlite")

    client = client_for(result["uri"])
    runs = mlflow_runs(client)
    assert set(runs) == {*names.values(), STUDY_RUN_ID}
    lora, failed, stopped = (runs[names[n]] for n in ("lora", "no-such-optimizer", "stopped"))
    baseline, evaluation = runs[names["baseline"]], runs[names["eval-validation"]]

    # params: the resolved config, flattened
    assert lora.data.params["training.lr"] == "0.005"
    assert lora.data.params["adaptation.target_modules"] == '["query", "value"]'
    assert failed.data.params["training.optimizer"] == "NoSuchOptimizer"
    # tags: identity, lineage, status and reason
    tags = lora.data.tags
    assert tags["tunelab.why"] == "LoRA r8 on query and value" and tags["tunelab.kind"] == "train"
    assert (
        tags["tunelab.hypothesis_version"] == "1" and len(tags["tunelab.hypothesis_sha256"]) == 64
    )
    assert tags["tunelab.data_snapshot"] and len(tags["tunelab.base.sha256"]) == 64
    assert len(tags["tunelab.eval_spec_sha256"]) == 64 and "torch 2." in tags["tunelab.core.env"]
    assert tags["tunelab.stages.compare.guardrails"] in ("pass", "fail", "inconclusive")
    assert tags["tunelab.stages.compare.decision"] in ("adopt", "reject", "inconclusive")
    assert (lora.info.status, failed.info.status, stopped.info.status) == (
        "FINISHED",
        "FAILED",
        "KILLED",
    )
    assert failed.data.tags["tunelab.parent"] == names["lora"]
    assert "unknown optimizer" in failed.data.tags["tunelab.reason"]
    assert "SIGTERM after step 3" in stopped.data.tags["tunelab.reason"]
    invalid = runs[names["frozen"]]
    assert invalid.info.status == "FAILED" and invalid.data.tags["tunelab.status"] == "invalid"
    assert "update check" in invalid.data.tags["tunelab.reason"]
    assert evaluation.data.tags["mlflow.parentRunId"] == lora.info.run_id

    # step metrics with their steps, as metrics.jsonl holds them
    rows = read_jsonl(study.runs_dir / names["lora"] / "metrics.jsonl")
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert history(client, lora, "train/loss") == losses and len(losses) == STEPS
    assert [s for s, _ in history(client, lora, "validation/loss")] == [0, 2, 4, 6]
    assert [s for s, _ in history(client, stopped, "train/loss")] == [1, 2, 3]
    # evaluation metrics: overall and per category, on the eval run and the run it evaluates
    record = json.loads(
        (study.runs_dir / names["eval-validation"] / "metrics-validation.json").read_text()
    )["metrics"]
    for run in (evaluation, lora):
        assert run.data.metrics["validation/macro_f1"] == pytest.approx(record["macro_f1"])
        assert run.data.metrics["validation/per_category/sport/f1"] == pytest.approx(
            record["per_category"]["sport"]["f1"]
        )
    assert "validation/accuracy" in baseline.data.metrics
    # artifacts: the records, predictions, the comparison, the dossier
    assert {"config.json", "status.json", "metrics.jsonl"} <= artifacts(client, lora, "records")
    assert "predictions-validation.jsonl" in artifacts(client, evaluation, "records")
    assert len(artifacts(client, lora, "compare")) == 1
    assert {"dossier.html", "dossier.md"} <= artifacts(client, runs[STUDY_RUN_ID], "report")
    assert artifacts(client, runs[STUDY_RUN_ID], "hypothesis") == {"hypothesis-v1.json"}


def test_sync_again_duplicates_nothing(study_dir, sqlite_uri):
    study = Study.open(study_dir)
    sync_mlflow(study, sqlite_uri, experiment="again")
    again = sync_mlflow(study, sqlite_uri, experiment="again")
    assert again["counts"] == {"created": 0, "updated": 0, "unchanged": MIRRORS}
    client = client_for(again["uri"])
    before = {r: run.data for r, run in mlflow_runs(client, "again").items()}
    # without the sync marks, every run is compared value by value: nothing is sent twice
    for run in mlflow_runs(client, "again").values():
        client.delete_tag(run.info.run_id, SYNC_TAG)
    third = sync_mlflow(study, sqlite_uri, experiment="again")
    assert third["counts"]["updated"] == MIRRORS
    assert all(r["metrics"] == 0 and r["params"] == 0 for r in third["runs"])
    runs = mlflow_runs(client, "again")
    assert len(runs) == MIRRORS
    name = runs_by_kind_name(study)["lora"]
    assert [s for s, _ in history(client, runs[name], "train/loss")] == list(range(1, STEPS + 1))
    assert runs[name].data.params == before[name].params


def test_changed_status_is_updated(study_dir, tmp_path, sqlite_uri):
    """The interrupted run, resumed to completion, becomes FINISHED in MLflow with its missing
    steps, and the steps it held stay single."""
    from tunelab.stages.train import resume_run

    root = tmp_path / "copy"
    shutil.copytree(study_dir, root)
    study = Study.open(root)
    sync_mlflow(study, sqlite_uri, experiment="status")
    stopped = runs_by_kind_name(study)["stopped"]
    resume_run(study, stopped)
    result = sync_mlflow(study, sqlite_uri, experiment="status")
    actions = {r["run_id"]: r["action"] for r in result["runs"]}
    assert actions.pop(stopped) == "updated" and set(actions.values()) == {"unchanged"}
    client = client_for(result["uri"])
    run = mlflow_runs(client, "status")[stopped]
    assert run.info.status == "FINISHED" and run.data.tags["tunelab.status"] == "completed"
    assert "tunelab.reason" not in run.data.tags or "resumed" in run.data.tags["tunelab.reason"]
    losses = [
        (r["step"], r["loss"])
        for r in read_jsonl(root / "records" / "runs" / stopped / "metrics.jsonl")
        if "loss" in r
    ]
    assert history(client, run, "train/loss") == losses and len(losses) == STEPS


def test_cli_track_table_json_and_errors(study_dir, tmp_path, sqlite_uri, capsys):
    uri = sqlite_uri
    code, out, err = run_cli(
        capsys, "track", "-s", study_dir, "--mlflow", uri, "--experiment", "cli"
    )
    assert code == 0, err
    assert f"track {MIRRORS}/{MIRRORS} (100%)" in err  # the progress board's line in a pipe
    assert (
        f"{MIRRORS} created, 0 updated, 0 unchanged" in out
        and "mlflow ui --backend-store-uri" in out
    )
    table = [line for line in out.splitlines() if not line.startswith("see it:")]
    assert max(len(line) for line in table) <= 80
    code, out, err = run_cli(
        capsys, "track", "-s", study_dir, "--mlflow", uri, "--experiment", "cli", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["counts"] == {"created": 0, "updated": 0, "unchanged": MIRRORS}
    assert "(100%)" not in err  # no progress under --json

    code, out, err = run_cli(capsys, "track", "-s", study_dir)
    assert code == 2 and "no MLflow tracking URI" in err and "MLFLOW_TRACKING_URI" in err
    (tmp_path / "a-file").write_text("")
    code, out, err = run_cli(capsys, "track", "-s", study_dir, "--mlflow", tmp_path / "a-file")
    assert code == 2 and "is a file" in err
    port = free_port()
    code, out, err = run_cli(
        capsys, "track", "-s", study_dir, "--mlflow", f"http://127.0.0.1:{port}"
    )
    assert code == 2 and "did not answer" in err


# ------------------------------------------------------------------ while training


def test_tensorboard_events_hold_the_step_metrics(study_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    study = Study.open(study_dir)
    run_dir = study.runs_dir / runs_by_kind_name(study)["lora"]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    rows = read_jsonl(run_dir / "metrics.jsonl")

    def scalars(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    for key, tag in [
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("tokens_per_s", "train/tokens_per_s"),
        ("memory_bytes", "system/memory_bytes"),
    ]:
        expected = [(r["step"], r[key]) for r in rows if key in r]
        assert [s for s, _ in scalars(tag)] == [s for s, _ in expected] == list(range(1, STEPS + 1))
        assert [v for _, v in scalars(tag)] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [s for s, _ in scalars("validation/loss")] == [0, 2, 4, 6]


def test_live_mlflow_metrics_then_sync_adds_no_duplicate(
    study_dir, tmp_path, sqlite_uri, monkeypatch
):
    from tunelab.stages.train import stage as train_stage

    root = tmp_path / "copy"
    shutil.copytree(study_dir, root)
    uri = sqlite_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "live")  # not the study's name
    study = Study.open(root, ["training.log_to=[mlflow]"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackingWarning)
        run = train_stage.run(study, name="live")
    client = client_for(uri)
    ml = mlflow_runs(client, "live")[run.id]
    rows = read_jsonl(run.dir / "metrics.jsonl")
    assert ml.info.status == "FINISHED" and ml.data.params["training.log_to"] == '["mlflow"]'
    assert history(client, ml, "train/loss") == [
        (r["step"], r["loss"]) for r in rows if "loss" in r
    ]
    assert [s for s, _ in history(client, ml, "validation/loss")] == [0, 2, 4, 6]
    result = sync_mlflow(Study.open(root), uri, experiment="live")
    assert {r["run_id"]: r["action"] for r in result["runs"]}[run.id] == "updated"
    ml = mlflow_runs(client, "live")[run.id]
    assert [s for s, _ in history(client, ml, "train/loss")] == list(range(1, STEPS + 1))


def test_dead_server_warns_once_and_training_is_unchanged(study_dir, tmp_path, monkeypatch):
    from tunelab.stages.train import stage as train_stage

    root = tmp_path / "copy"
    shutil.copytree(study_dir, root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    study = Study.open(root, ["training.log_to=[tensorboard, mlflow]"])
    with pytest.warns(TrackingWarning) as caught:
        run = train_stage.run(study, name="dead-server")
    messages = [str(w.message) for w in caught if w.category is TrackingWarning]
    assert len(messages) == 1 and "mlflow" in messages[0] and "did not answer" in messages[0]
    assert run.status()["status"] == "completed"
    reference = study.runs_dir / runs_by_kind_name(study)["lora"] / "metrics.jsonl"
    assert [r["loss"] for r in read_jsonl(run.dir / "metrics.jsonl") if "loss" in r] == [
        r["loss"] for r in read_jsonl(reference) if "loss" in r
    ]
    assert list((run.dir / "tensorboard").glob("events.out.tfevents.*"))


def test_live_logger_without_the_extra_warns_naming_it(study_dir, monkeypatch):
    from tunelab.track.live import LiveLogger

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///unused.db")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    study = Study.open(study_dir)
    run = study.get_run(runs_by_kind_name(study)["lora"])
    with pytest.warns(TrackingWarning, match=r"pip install 'tunelab\[tracking\]'"):
        live = LiveLogger.start(run, ["mlflow"])
        live.log({"step": 1, "loss": 1.0})
        live.close()


# ------------------------------------------------------------------ a server over HTTP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_serving(args: list[str], cwd: Path, env: dict[str, str]) -> Iterator[str]:
    """`mlflow ARGS --host 127.0.0.1 --port P` (P free), waited for until /health answers and
    stopped (its process group) at the end. Yields its URL."""
    port = free_port()
    log = open(cwd / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
        env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job workers
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"mlflow {args[0]} did not start:\n" + (cwd / "server.log").read_text()[-3000:]
                )
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on 127.0.0.1 at a free port with a SQLite store of its own."""
    args = [
        "server",
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'server.db'}",
        "--artifacts-destination",
        str(tmp_path / "server-artifacts"),
    ]
    with mlflow_serving(args, tmp_path, dict(os.environ)) as url:
        yield url


@pytest.mark.slow
def test_sync_over_http_to_a_server(study_dir, mlflow_server):
    study = Study.open(study_dir)
    first = sync_mlflow(study, mlflow_server)
    assert first["kind"] == "http" and first["counts"]["created"] == MIRRORS
    assert sync_mlflow(study, mlflow_server)["counts"]["unchanged"] == MIRRORS
    client = client_for(mlflow_server)
    runs = mlflow_runs(client)
    names = runs_by_kind_name(study)
    lora = runs[names["lora"]]
    rows = read_jsonl(study.runs_dir / names["lora"] / "metrics.jsonl")
    assert history(client, lora, "train/loss") == [
        (r["step"], r["loss"]) for r in rows if "loss" in r
    ]
    assert runs[names["no-such-optimizer"]].info.status == "FAILED"
    assert "predictions-validation.jsonl" in artifacts(
        client, runs[names["eval-validation"]], "records"
    )


def no_file_store_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}


@pytest.mark.slow
def test_a_bare_folder_is_a_store_mlflow_opens_as_it_is(study_dir, tmp_path, capsys):
    """`tunelab track --mlflow ./mlruns` into a new folder: MLflow's own client and the
    `mlflow ui` command tunelab prints open it with no MLFLOW_* setting."""
    folder = tmp_path / "mlruns"
    code, out, err = run_cli(capsys, "track", "-s", study_dir, "--mlflow", folder)
    assert code == 0, err
    assert (folder / "mlflow.db").is_file() and not is_file_store(folder)
    see = next(line for line in out.splitlines() if line.startswith("see it: "))
    command = see.removeprefix("see it: ").strip("`").split()
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    assert command == ["mlflow", "ui", "--backend-store-uri", uri]
    count = (
        "import sys; from mlflow.tracking import MlflowClient; c = MlflowClient(sys.argv[1]); "
        "e = c.get_experiment_by_name(sys.argv[2]); "
        "print(len(c.search_runs([e.experiment_id])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", count, uri, NAME],
        env=no_file_store_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) == MIRRORS
    with mlflow_serving(command[1:], tmp_path, no_file_store_env()) as url:
        with urllib.request.urlopen(f"{url}/", timeout=30) as reply:
            assert reply.status == 200 and b"<html" in reply.read().lower()
        query = urllib.parse.urlencode({"experiment_name": NAME})
        api = f"{url}/api/2.0/mlflow/experiments/get-by-name?{query}"
        with urllib.request.urlopen(api, timeout=30) as reply:
            assert json.loads(reply.read())["experiment"]["name"] == NAME


# ------------------------------------------------------------------ Weights & Biases offline


def wandb_records(path: Path):
    """The records of an offline run file (`run-<id>.wandb`: wandb's LevelDB-style log of
    protobuf records, 32 KiB blocks after a 7-byte header), parsed with wandb's own Record."""
    import struct

    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending + payload if kind == 4 else payload)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += payload


def wandb_offline_runs(folder: Path) -> dict[str, dict]:
    """Every offline run folder under `folder`, by W&B run id: its folders, exit code,
    summary, config and history steps (folders of one id merged in order, as `wandb sync`
    uploads them)."""
    runs: dict[str, dict] = {}
    for run_dir in sorted(folder.glob("wandb/offline-run-*")):
        (log,) = run_dir.glob("run-*.wandb")
        for r in wandb_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run = runs.setdefault(r.run.run_id, {"dirs": [], "summary": {}, "steps": []})
                run["dirs"].append(run_dir)
                run["config"] = {i.key: json.loads(i.value_json) for i in r.run.config.update}
                run["group"] = r.run.run_group
            elif kind == "summary":
                for item in r.summary.update:
                    run["summary"]["/".join(item.nested_key) or item.key] = json.loads(
                        item.value_json
                    )
            elif kind == "config":
                for item in r.config.update:
                    run["config"]["/".join(item.nested_key) or item.key] = json.loads(
                        item.value_json
                    )
            elif kind == "history":
                run["steps"].append(r.history.step.num)
            elif kind == "exit":
                run["exit_code"] = r.exit.exit_code
    return runs


@pytest.mark.slow
def test_wandb_offline_twice_one_run_each(study_dir, tmp_path, monkeypatch):
    from tunelab.track.wandb_mirror import EXIT_CODE, sync_wandb, wandb_run_id

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    study = Study.open(study_dir)
    first = sync_wandb(study, directory=tmp_path)
    again = sync_wandb(study, directory=tmp_path)
    assert first["counts"]["created"] == MIRRORS and first["mode"] == "offline"
    assert again["counts"] == {"created": 0, "updated": 0, "unchanged": MIRRORS}
    runs = wandb_offline_runs(tmp_path)
    rows = study.list_runs()
    ids = {row.id: wandb_run_id(NAME, row.id) for row in rows}
    assert set(runs) == {*ids.values(), wandb_run_id(NAME, STUDY_RUN_ID)}
    assert all(len(r["dirs"]) == 1 for r in runs.values())  # one offline folder per run
    for row in rows:
        run = runs[ids[row.id]]
        assert run["summary"]["tunelab.status"] == row.status
        assert run["exit_code"] == EXIT_CODE[row.status]
        assert run["config"]["tunelab.run_id"] == row.id
    names = runs_by_kind_name(study)
    lora, evaluation = runs[ids[names["lora"]]], runs[ids[names["eval-validation"]]]
    metrics = read_jsonl(study.runs_dir / names["lora"] / "metrics.jsonl")
    last_loss = [r["loss"] for r in metrics if "loss" in r][-1]
    assert lora["summary"]["train/loss"] == pytest.approx(last_loss)
    assert lora["steps"] == sorted({r["step"] for r in metrics})
    record = json.loads(
        (study.runs_dir / names["eval-validation"] / "metrics-validation.json").read_text()
    )["metrics"]
    assert evaluation["summary"]["validation/macro_f1"] == pytest.approx(record["macro_f1"])
    assert evaluation["group"] == lora["group"] == names["lora"]
    assert lora["config"]["training.lr"] == "0.005"
    records = Path(lora["dirs"][0]) / "files" / "records"
    assert {"config.json", "metrics.jsonl"} <= {p.name for p in records.iterdir()}


@pytest.mark.slow
def test_cli_track_wandb_offline_and_without_the_extra(study_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    args = ("track", "-s", study_dir, "--wandb", "--wandb-mode", "offline")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert f"{MIRRORS} created, 0 updated, 0 unchanged" in out and "wandb sync" in out
    assert "mlflow" not in out.lower()  # no MLflow URI given: W&B only
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["wandb"]["counts"]["unchanged"] == MIRRORS
    monkeypatch.setitem(sys.modules, "wandb", None)
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and "pip install 'tunelab[tracking]'" in err


CLI = "import sys; from tunelab.cli import main; main(sys.argv[1:])"
TRACKIO_SCRIPT = """
import json, sys
from tunelab.core.study import Study
from tunelab.track.trackio_mirror import sync_trackio
study = Study.open(sys.argv[1])
counts = [sync_trackio(study)["counts"] for _ in range(2)]
from trackio.sqlite_storage import SQLiteStorage
names = SQLiteStorage.get_runs(sys.argv[2])
runs = {n: {"config": SQLiteStorage.get_run_config(sys.argv[2], n),
            "logs": SQLiteStorage.get_logs(sys.argv[2], n)} for n in names}
print(json.dumps({"counts": counts, "names": names, "runs": runs}, default=str))
"""


@pytest.mark.slow
def test_trackio_store_twice_one_run_each(study_dir, tmp_path):
    """Trackio fixes its store when imported: the mirror runs in a process of its own with
    TRACKIO_DIR in a temporary folder, and that process opens the store with Trackio's own
    SQLiteStorage."""
    from tunelab.track.wandb_mirror import wandb_run_id

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", TRACKIO_SCRIPT, str(study_dir), NAME],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["counts"][0]["created"] == MIRRORS
    assert out["counts"][1] == {"created": 0, "updated": 0, "unchanged": MIRRORS}
    study = Study.open(study_dir)
    rows = study.list_runs()
    assert sorted(out["names"]) == sorted(
        [wandb_run_id(NAME, r.id) for r in rows] + [wandb_run_id(NAME, STUDY_RUN_ID)]
    )
    for row in rows:
        run = out["runs"][wandb_run_id(NAME, row.id)]
        assert run["config"]["tunelab.status"] == row.status
    names = runs_by_kind_name(study)
    lora = out["runs"][names["lora"]]["logs"]
    metrics = read_jsonl(study.runs_dir / names["lora"] / "metrics.jsonl")
    losses = [(r["step"], r["loss"]) for r in metrics if "loss" in r]
    assert [(x["step"], x["train/loss"]) for x in lora if "train/loss" in x] == [
        (s, pytest.approx(v)) for s, v in losses
    ]
    record = json.loads(
        (study.runs_dir / names["eval-validation"] / "metrics-validation.json").read_text()
    )["metrics"]
    evaluation = out["runs"][names["eval-validation"]]["logs"]
    f1 = [x["validation/macro_f1"] for x in evaluation if "validation/macro_f1" in x]
    assert f1 == [pytest.approx(record["macro_f1"])]
    cli = subprocess.run(
        [sys.executable, "-c", CLI, "track", "-s", str(study_dir), "--trackio", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert json.loads(cli.stdout)["trackio"]["counts"]["unchanged"] == MIRRORS


@pytest.mark.slow
def test_live_wandb_then_sync_sends_no_step_twice(study_dir, tmp_path, monkeypatch):
    from tunelab.stages.train import stage as train_stage
    from tunelab.track.wandb_mirror import sync_wandb, wandb_run_id

    root = tmp_path / "copy"
    shutil.copytree(study_dir, root)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    study = Study.open(root, ["training.log_to=[wandb]"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackingWarning)
        run = train_stage.run(study, name="live")
    steps = sorted({r["step"] for r in read_jsonl(run.dir / "metrics.jsonl")})
    live = wandb_offline_runs(tmp_path)[wandb_run_id(NAME, run.id)]
    assert live["steps"] == steps and live["exit_code"] == 0
    result = sync_wandb(Study.open(root))
    assert {r["run_id"]: r["action"] for r in result["runs"]}[run.id] == "updated"
    after = wandb_offline_runs(tmp_path)[wandb_run_id(NAME, run.id)]
    assert len(after["dirs"]) == 2 and after["steps"] == steps  # no step sent twice
    assert after["summary"]["tunelab.status"] == "completed"
