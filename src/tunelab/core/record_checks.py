"""Typed records and pieces that verify, compare and the trackers read: an evaluation as
found, a run's compute.json, the fresh process's spec and outcome, and a tracker sync's
summary. A run's saved training settings, an evaluation's copy (`merge`) and an environment
difference are pieces of run records: core/run_parts.

Each is a `Record` read at a place inside its record file or message (`where`), so a damaged
piece raises the located `StudyError` (core/record_base) instead of a KeyError.

| kind             | what                                   | written by                      |
|------------------|----------------------------------------|---------------------------------|
| `ExampleVerdicts` | a prediction's `verdicts` (extraction) | lib.tasks.extraction           |
| `FoundEvaluation` | runs/<run>/metrics-<split>.json, found | core.evidence.find_evaluation  |
| `RunCompute`     | runs/<run>/compute.json                | stages.train                    |
| `FreshSpec`      | the fresh process's spec               | stages.verify.fresh             |
| `FreshOutcome`   | what the fresh process returns         | stages.verify.fresh             |
| `SentState`      | a run in a tracker's sync state file   | track.wandb_mirror, trackio_mirror |
| `TrackerSync`    | `tunelab track`'s summary of one tracker | track.*_mirror                |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.record_base import Record
from tunelab.core.record_types import Evaluation

__all__ = [
    "ExampleVerdicts",
    "FoundEvaluation",
    "FreshOutcome",
    "FreshSpec",
    "PrecisionChoice",
    "RunCompute",
    "SentState",
    "SyncCounts",
    "SyncRow",
    "TrackerSync",
]


@dataclass(frozen=True)
class PrecisionChoice(Record):
    """The precision a run asked for, the one it computed in, and why."""

    requested: str | None = None
    used: str = ""
    why: str | None = None


@dataclass(frozen=True)
class RunCompute(Record):
    """runs/<run>/compute.json: how a training run computed (stages.train.compute
    .describe_compute): its device and precision; compile, attention and loss checks as
    written."""

    device: str | None = None

    @property
    def precision(self) -> PrecisionChoice:
        return self.part(PrecisionChoice, "precision") or PrecisionChoice.of(
            self.path, {}, "precision"
        )

    def check_parts(self) -> None:
        _ = self.precision


@dataclass(frozen=True)
class FoundEvaluation:
    """An evaluation as `core.evidence.find_evaluation` finds it: the run that recorded it,
    that run's folder, and its metrics-<split>.json typed (`found` keeps the finder's dict,
    which `stages.evaluate.stage.load_predictions` reads)."""

    eval_run: str
    dir: Path
    record: Evaluation
    found: Mapping[str, Any] = field(repr=False)

    @classmethod
    def of(cls, found: Mapping[str, Any], split: str) -> FoundEvaluation:
        folder = Path(found["dir"])
        path = folder / f"metrics-{split}.json"
        return cls(str(found["eval_run"]), folder, Evaluation.of(path, found["record"]), found)

    @property
    def predictions_path(self) -> Path:
        return self.dir / f"predictions-{self.record.split}.jsonl"


@dataclass(frozen=True)
class ExampleVerdicts(Record):
    """How a generative task judged one example: its output parsed, valid, matched; an
    extraction's counts per schema path in `paths` ({path: {slots, present, exact, ...}})."""

    json_valid: bool | None = None
    schema_valid: bool | None = None
    exact_match: bool | None = None
    all_fields_match: bool | None = None
    paths: dict[str, Any] | None = None

    def path_count(self, path: str, key: str) -> Any:
        """The count `key` of schema path `path` (0 when the example has none)."""
        return ((self.paths or {}).get(path) or {}).get(key, 0)


@dataclass(frozen=True)
class FreshSpec(Record):
    """What the fresh process of verify and smoke re-evaluates (stages.verify.fresh): the study,
    the run, the examples by id, and the extra checks a smoke asks for."""

    study: str = ""
    run: str = ""
    snapshot: str = ""
    split: str = ""
    ids: list[Any] = field(default_factory=list)
    overrides: list[str] | None = None
    labels: list[str] | None = None
    probe_ids: list[Any] | None = None
    val_loss_ids: list[Any] | None = None
    num_threads: int | None = None
    merge: bool | None = None  # the recorded evaluation's copy; None lets it choose


@dataclass(frozen=True)
class FreshOutcome(Record):
    """What the fresh process found (`fresh_evaluate`): its predictions, timings (seconds),
    the evaluation spec it ran and its environment (core.env.capture_env). `probe_logits`, a
    tensor, stays in `raw`."""

    load_s: float = 0.0
    eval_s: float = 0.0
    process_s: float = 0.0
    checks_s: float | None = None
    spec_sha256: str | None = None
    val_loss: float | None = None
    metrics: dict[str, Any] | None = None
    merge: dict[str, Any] | None = None
    base_identity_sha256: str | None = None
    pid: int | None = None
    env: dict[str, Any] | None = None
    predictions: list[dict[str, Any]] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class SentState(Record):
    """What a tracker sync sent of one run (its entry in the sync state file): the mirror's
    fingerprint and the last step sent (None: none yet)."""

    sha256: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class SyncCounts(Record):
    """How many mirrored runs a sync created, updated and left unchanged."""

    created: int = 0
    updated: int = 0
    unchanged: int = 0


@dataclass(frozen=True)
class SyncRow(Record):
    """One run as a tracker sync left it: its status, what was done, values and files sent."""

    run_id: str = ""
    status: str | None = None
    action: str | None = None  # created | updated | unchanged
    metrics: int = 0  # values sent
    files: int = 0  # files sent


@dataclass(frozen=True)
class TrackerSync(Record):
    """`tunelab track`'s summary of one tracker (track.mlflow_mirror, wandb_mirror,
    trackio_mirror): where it wrote, and per run what it did."""

    kind: str | None = None  # MLflow: http | folder | sqlite
    uri: str | None = None  # MLflow's tracking URI
    experiment: dict[str, Any] | None = None  # MLflow: {name, id}
    project: str | None = None  # W&B and Trackio
    mode: str | None = None  # W&B: online | offline
    dir: str | None = None  # W&B and Trackio: the folder it wrote

    @property
    def counts(self) -> SyncCounts:
        return self.part(SyncCounts, "counts") or SyncCounts(self.path, {}, where="counts")

    @property
    def runs(self) -> list[SyncRow]:
        return self.parts(SyncRow, "runs")

    @property
    def experiment_name(self) -> Any:
        return (self.experiment or {}).get("name")

    @property
    def experiment_id(self) -> Any:
        return (self.experiment or {}).get("id")

    def check_parts(self) -> None:
        _ = self.counts, self.runs
