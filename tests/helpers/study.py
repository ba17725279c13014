"""The one study factory of the tests: a study folder with its data rows and study.yaml.

`build_study(root, kind, ...)` starts from the study.yaml `tunelab init` writes for `kind`
(`template=False`: from only the sections given; `example="format-spam"`: from that example's
study.yaml, its folder copied with `copy_example=True`), fills the hypothesis, writes `rows` as JSONL,
points the model at `model_dir`, applies `set` (dotted paths, each value replacing what is there, as
`--set` does) and then `sections` (each updating its section: `training={"max_steps": 4}`; a
list or a value replaces it), writes study.yaml, and with `register=True` registers the
hypothesis and builds the data snapshot. The `make_study` fixture of conftest builds one under
the test's temporary folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from helpers import filled_hypothesis, register_study

JSONL_FIELDS = {"id": "id", "text": "text", "label": "label", "split": "split"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` as a JSONL file at `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = raw
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def build_study(
    root: Path,
    kind: str = "classification",
    *,
    name: str = "test",
    model_dir: Path | str | None = None,
    rows: list[dict[str, Any]] | None = None,
    data_file: str = "data.jsonl",
    template: bool = True,
    hypothesis: dict[str, Any] | None = None,
    set: dict[str, Any] | None = None,  # noqa: A002 - named for `tunelab --set`
    register: bool = False,
    snapshot: bool = True,
    example: str | None = None,
    copy_example: bool = False,
    **sections: Any,
) -> Path:
    """Write a study folder at `root` (see the module docstring); returns `root`.

    `rows` are written to `data_file` and the data source points at it (a template study's
    fields are then `JSONL_FIELDS` unless `set` or `sections` say otherwise).
    """
    from tunelab.stages.hypothesis.template import render_study_yaml

    root.mkdir(parents=True, exist_ok=True)
    if example is not None:
        if copy_example:
            shutil.copytree(EXAMPLES / example, root, dirs_exist_ok=True)
        raw = yaml.safe_load((EXAMPLES / example / "study.yaml").read_text())
        if hypothesis is not None:
            raw["hypothesis"] = hypothesis
    elif template:
        raw = yaml.safe_load(render_study_yaml(kind, name))
        raw["hypothesis"] = hypothesis or filled_hypothesis(raw)
    else:
        raw = {"name": name}
        if hypothesis is not None:
            raw["hypothesis"] = hypothesis
    if rows is not None:
        write_rows(root / data_file, rows)
        _set_path(raw, "data.source", {"format": "jsonl", "path": data_file})
        if template:
            _set_path(raw, "data.fields", dict(JSONL_FIELDS))
            _set_path(raw, "data.dedup.near", False)
    if model_dir is not None:
        _set_path(raw, "model.path", str(model_dir))
    for dotted, value in (set or {}).items():
        _set_path(raw, dotted, value)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    if register:
        register_study(root, snapshot=snapshot)
    return root
