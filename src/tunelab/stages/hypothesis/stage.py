"""Locking the hypothesis, the guardrails and the evaluation procedure before any computing.

`run(study)` writes records/hypothesis-vN.json (content, sha256, UTC time). Registering a
changed hypothesis makes vN+1 with the diff against vN; earlier versions are never touched.
Stages that compute on a model call `require_hypothesis(study)` and carry its version and sha.

- `require_hypothesis(study_root, cfg) -> {version, sha256, evaluation_spec_sha256}` raises
  HypothesisError when none is registered, when study.yaml drifted from the latest version, or
  when a hub repo or revision study.yaml names is not the one pinned.
- `run(root, cfg, pins=None)`: `pins` go into the locked `content["pins"]` (`{"model" |
  "data": {repo_id, repo_type, revision, commit}}`, hub repos only; the comparison with
  study.yaml leaves them out).
- The records are read back by `core.evidence` (`read_hypothesis`, `latest_hypothesis`,
  `all_hypotheses`, `pins_of`, `pinned_commit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tunelab.core.config import StudyConfig, contradictions, sourced_problems
from tunelab.core.errors import HypothesisError
from tunelab.core.evidence import latest_hypothesis
from tunelab.core.hashing import sha256_json
from tunelab.core.ledger import utc_now
from tunelab.core.record_types import Hypothesis
from tunelab.core.records import write_json_atomic
from tunelab.lib.metrics import study_metric_problems

TEMPLATE_MARK = "TODO"


def locked_content(cfg: StudyConfig) -> dict[str, Any]:
    """What registration locks: the question, what must not get worse, and how it is measured."""
    return {
        "study": cfg.name,
        "task_kind": cfg.task.kind,
        "hypothesis": cfg.hypothesis.model_dump(mode="json"),
        "guardrails": [g.model_dump(mode="json") for g in cfg.guardrails],
        "evaluation_spec": cfg.evaluation_spec(),
    }


def evaluation_spec_sha(cfg: StudyConfig) -> str:
    return sha256_json(cfg.evaluation_spec())


def diff_dicts(old: Any, new: Any, prefix: str = "") -> list[dict[str, Any]]:
    """Flat list of {path, old, new} for every leaf that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            out += diff_dicts(old.get(key), new.get(key), path)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out += diff_dicts(a, b, f"{prefix}[{i}]")
        return out
    return [] if old == new else [{"path": prefix, "old": old, "new": new}]


def check_registrable(cfg: StudyConfig, overrides: Sequence[str] = ()) -> None:
    """Refuse a template hypothesis, no guardrails, or settings `tunelab validate` refuses that
    the lock would hold: contradictions, a task section that cannot be built, a metric the task
    never records (before anything is resolved or written). `overrides`: the `--set` items
    the config was loaded with, named where a problem comes from one."""
    from tunelab.lib.tasks import task_problems

    problems = contradictions(cfg) + task_problems(cfg.task) + study_metric_problems(cfg)
    for field, value in cfg.hypothesis.model_dump().items():
        if isinstance(value, str) and (not value.strip() or TEMPLATE_MARK in value):
            problems.append(f"hypothesis.{field} is still the template ({value!r})")
    if not cfg.guardrails:
        problems.append("guardrails is empty: say what must not get worse")
    if problems:
        _, lines, what = sourced_problems(problems, "study.yaml", overrides)
        raise HypothesisError(
            "cannot register: " + "; ".join(line.removeprefix("  - ") for line in lines),
            hint=f"change {what} (`tunelab validate` lists every problem), then "
            "`tunelab register` again",
        )


def run(
    study_root: Path,
    cfg: StudyConfig,
    pins: dict[str, Any] | None = None,
    power: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Lock the current hypothesis. Returns (record, created); unchanged content creates nothing.

    `pins` (from `tunelab.stages.hypothesis.pins.resolve_pins`): the commit of each hub repo the study names,
    locked with the rest under `content["pins"]`. `power` (from
    `tunelab.stages.hypothesis.power.registration_power`): what the validation split can
    detect, kept beside the content (`detectable_effect`, `power`), outside its sha256.
    """
    check_registrable(cfg)
    records = Path(study_root) / "records"
    content = locked_content(cfg)
    if pins:
        content["pins"] = pins
    sha = sha256_json(content)
    previous = latest_hypothesis(records)
    if previous and previous.sha256 == sha:
        return previous.raw, False
    version = (previous.version + 1) if previous else 1
    record = {
        "version": version,
        "sha256": sha,
        "registered_at": utc_now(),
        "evaluation_spec_sha256": sha256_json(content["evaluation_spec"]),
        "content": content,
        "amends": previous and {"version": previous.version, "sha256": previous.sha256},
        "diff": diff_dicts(previous.content, content) if previous else [],
    }
    if power is not None:
        record |= {"detectable_effect": power.get("detectable_effect"), "power": power}
    write_json_atomic(records / f"hypothesis-v{version}.json", record)
    return record, True


def require_hypothesis(study_root: Path, cfg: StudyConfig) -> dict[str, Any]:
    """The registered hypothesis the current config matches; refuses when none or stale."""
    records = Path(study_root) / "records"
    latest = latest_hypothesis(records)
    if latest is None:
        raise HypothesisError(
            "no hypothesis is registered for this study",
            hint="write hypothesis and guardrails in study.yaml, then run `tunelab register`",
        )
    current = locked_content(cfg)
    locked = {k: v for k, v in latest.content.items() if k != "pins"}
    if sha256_json(current) != sha256_json(locked):
        changed = ", ".join(d["path"] for d in diff_dicts(locked, current)[:6])
        raise HypothesisError(
            f"study.yaml changed what hypothesis v{latest.version} locked ({changed})",
            hint="run `tunelab register` to record the amendment as a new version, or undo the edit",
        )
    _check_pins(cfg, latest)
    return {
        "version": latest.version,
        "sha256": latest.sha256,
        "evaluation_spec_sha256": latest.evaluation_spec_sha256,
    }


def _check_pins(cfg: StudyConfig, latest: Hypothesis) -> None:
    """Every hub repo study.yaml names must be the one (and the revision) the record pinned."""
    for key, ref in cfg.hub_refs().items():
        pin = latest.pins.get(key)
        if pin and (pin.repo_id, pin.repo_type, pin.revision) == (
            ref["repo_id"], ref["repo_type"], ref["revision"]
        ):  # fmt: skip
            continue
        was = f"{pin.repo_id}@{pin.revision}" if pin else "nothing"
        raise HypothesisError(
            f"study.yaml names {key} {ref['repo_id']}@{ref['revision']}, hypothesis "
            f"v{latest.version} pinned {was}",
            hint="run `tunelab register` to pin it (a new version), or undo the edit",
        )
