"""The study folder: paths, config, ledger, and run records.

```
study.yaml                    the config the user edits
records/hypothesis-vN.json    locked hypothesis, guardrails, evaluation spec, sha256
records/data/<snapshot>/      manifest.json, split files, duplicate report
records/runs/<run-id>/        config.json, env.json, status.json, metrics.jsonl, predictions-*.jsonl,
                              checkpoints/, DONE
records/ledger.sqlite         index of all of the above
report/                       dossier.html, dossier.md, plots
```

`Study.open(dir, overrides)`: `study.config`, `study.root`, `study.records`, `study.ledger`,
`study.resolve(path_from_config)` (`config.resolve_path` under the study's root),
`study.create_run(kind, config=, name=, parent=, why=, data_snapshot=, hypothesis=, env=,
extra=) -> Run` (the folder `records/runs/<id>/` with config.json, env.json, status.json),
`study.get_run(id) -> Run`, `study.list_runs()`. `run.set_status(status, reason)` (running |
completed | failed | invalid | interrupted), `run.heartbeat()`, `run.record` (config.json,
typed: core.record_types.RunConfig) and `run.config` (its study config, validated once).

`tunelab validate` gathers the checks of every layer in `tunelab.stages.hypothesis.validate`.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tunelab.core.config import (
    StudyConfig,
    load_config,
    resolve_path,
)
from tunelab.core.errors import RunError, StudyError
from tunelab.core.hashing import sha256_json
from tunelab.core.ledger import Ledger, RunRow, utc_now
from tunelab.core.record_types import RunConfig, RunStatus
from tunelab.core.records import read_json, write_json_atomic

RUN_STATUSES = ("running", "completed", "failed", "invalid", "interrupted")
# A running run whose heartbeat is older than this, and whose process is gone, was killed.
STALE_HEARTBEAT_S = 120.0


def new_run_id(kind: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{kind}-{stamp}-{secrets.token_hex(3)}"


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); look at its state where /proc exists.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class Run:
    study: Study
    id: str
    dir: Path

    @property
    def row(self) -> RunRow:
        row = self.study.ledger.get_run(self.id)
        if row is None:
            raise RunError(f"run {self.id} is not in the ledger")
        return row

    def path(self, name: str) -> Path:
        return self.dir / name

    @cached_property
    def record(self) -> RunConfig:
        """The run's config.json, typed (read once; a damaged one raises the located error)."""
        return RunConfig.read(self.dir / "config.json")

    @cached_property
    def config(self) -> StudyConfig:
        """The study config the run was started with, validated once."""
        return self.record.study_config()

    def set_status(self, status: str, reason: str | None = None, **extra: Any) -> None:
        """Record a status in status.json (replaced atomically) and in the ledger."""
        assert status in RUN_STATUSES, status
        finished = None if status == "running" else utc_now()
        payload = {"run_id": self.id, "status": status, "reason": reason, "at": utc_now(), **extra}
        write_json_atomic(self.dir / "status.json", payload, overwrite=True)
        self.study.ledger.update_run(
            self.id,
            status=status,
            reason=reason,
            finished_at=finished,
            heartbeat_at=utc_now(),
            pid=os.getpid(),
        )
        self.study.ledger.add_event(self.id, f"status:{status}", reason)

    def heartbeat(self) -> None:
        self.study.ledger.heartbeat(self.id)

    def status(self) -> dict[str, Any]:
        """status.json as written (`last_status` reads it typed)."""
        return read_json(self.dir / "status.json")

    def last_status(self) -> RunStatus:
        """status.json, typed."""
        return RunStatus.read(self.dir / "status.json")


class Study:
    """An opened study folder. `Study.open(dir)` checks it exists and loads its config."""

    def __init__(self, root: Path, config: StudyConfig, overrides: list[str] | None = None):
        self.root = Path(root).resolve()
        self.config = config
        self.overrides = list(overrides or [])
        self.records = self.root / "records"
        self.records.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.records / "ledger.sqlite")

    @classmethod
    def open(cls, root: Path | str, overrides: list[str] | None = None) -> Study:
        root = Path(root)
        cfg_path = root / "study.yaml"
        if not cfg_path.exists():
            raise StudyError(
                f"{root}: no study.yaml here",
                hint=f"create one with `tunelab init {root} --task classification`",
            )
        return cls(root, load_config(cfg_path, overrides), overrides)

    @property
    def config_path(self) -> Path:
        return self.root / "study.yaml"

    def resolve(self, path: str) -> Path:
        """A path from the config: `asset:NAME` (a packaged asset), absolute, or under the study."""
        return resolve_path(path, self.root)

    # ------------------------------------------------------------ runs

    @property
    def runs_dir(self) -> Path:
        return self.records / "runs"

    def create_run(
        self,
        kind: str,
        *,
        config: StudyConfig | None = None,
        name: str | None = None,
        parent: str | None = None,
        why: str | None = None,
        data_snapshot: str | None = None,
        hypothesis: dict[str, Any] | None = None,
        env: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Run:
        """Start a run record: a new id, its folder with config.json and env.json, a ledger row."""
        cfg = config or self.config
        if parent and self.ledger.get_run(parent) is None:
            raise RunError(f"parent run {parent!r} not found", hint="list runs with `tunelab runs`")
        run_id = new_run_id(kind)
        run_dir = self.runs_dir / run_id
        run_dir.mkdir(parents=True)
        config_record = {
            "run_id": run_id,
            "kind": kind,
            "name": name,
            "parent": parent,
            "why": why,
            "overrides": self.overrides,
            "config": cfg.to_dict(),
            "config_sha256": cfg.sha256(),
            "data_snapshot": data_snapshot,
            "hypothesis_version": hypothesis and hypothesis["version"],
            "hypothesis_sha256": hypothesis and hypothesis["sha256"],
            **(extra or {}),
        }
        write_json_atomic(run_dir / "config.json", config_record)
        env_sha = None
        if env is not None:
            write_json_atomic(run_dir / "env.json", env)
            env_sha = sha256_json(env)
        self.ledger.add_run(
            id=run_id,
            kind=kind,
            name=name,
            parent=parent,
            status="running",
            pid=os.getpid(),
            config_sha=cfg.sha256(),
            data_snapshot=data_snapshot,
            hypothesis_version=hypothesis and hypothesis["version"],
            hypothesis_sha=hypothesis and hypothesis["sha256"],
            env_sha=env_sha,
            why=why,
        )
        run = Run(self, run_id, run_dir)
        write_json_atomic(
            run_dir / "status.json",
            {"run_id": run_id, "status": "running", "reason": None, "at": utc_now()},
            overwrite=True,
        )
        return run

    def check_new_run(self, kind: str, name: str | None, parent: str | None) -> str | None:
        """Before a `kind` run named `name` starts: refuse a name another run of that kind has
        (every command that takes a run by name would find two), and return the parent's id
        (`parent` as any command takes a run: id, unique prefix or name)."""
        taken = [r.id for r in self.ledger.list_runs(kind) if name and r.name == name]
        if taken:
            raise RunError(
                f"--name {name!r} is taken by {kind} run {taken[0]}: a second one would make "
                f"{name!r} name two runs",
                hint=f"choose another --name; `tunelab resume {taken[0]}` continues that run if "
                "it was interrupted",
            )
        if not parent:
            return None
        try:
            return self.get_run(parent).id
        except RunError as exc:
            raise RunError(f"parent {exc.message}", hint=exc.hint) from None

    def get_run(self, run_id: str) -> Run:
        row = self.ledger.get_run(run_id)
        if row is None:
            matches = [
                r.id for r in self.ledger.list_runs() if r.id.startswith(run_id) or r.name == run_id
            ]
            if len(matches) == 1:
                row = self.ledger.get_run(matches[0])
            else:
                raise RunError(
                    f"run {run_id!r} not found" + (f" (ambiguous: {matches})" if matches else ""),
                    hint="list runs with `tunelab runs`",
                )
        assert row is not None
        return Run(self, row.id, self.runs_dir / row.id)

    def reconcile(self) -> list[str]:
        """Mark runs left 'running' by a killed process (SIGKILL, power loss) as interrupted."""
        found = []
        now = datetime.now(UTC)
        for row in self.ledger.list_runs():
            if row.status != "running" or _pid_alive(row.pid) and row.pid != os.getpid():
                continue
            if row.pid == os.getpid():
                continue
            beat = datetime.fromisoformat(
                (row.heartbeat_at or row.created_at).replace("Z", "+00:00")
            )
            if _pid_alive(row.pid) and (now - beat).total_seconds() < STALE_HEARTBEAT_S:
                continue
            Run(self, row.id, self.runs_dir / row.id).set_status(
                "interrupted",
                "process ended without a final status (killed); found by a stale heartbeat",
            )
            found.append(row.id)
        return found

    def list_runs(self, kind: str | None = None) -> list[RunRow]:
        self.reconcile()
        return self.ledger.list_runs(kind)
