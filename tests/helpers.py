"""Helpers for tests: run the CLI in-process, write small studies."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `tunelab ARGS` in this process; returns (exit code, stdout, stderr)."""
    from tunelab.cli import main

    code = 0
    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root (to prove a failed command changed nothing)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and not p.name.startswith("ledger.sqlite"):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


FILLED_HYPOTHESIS = {
    "behaviour": "route BBC articles to their topic",
    "rationale": "the encoder was not trained on these five topics",
    "expected_effect": "macro_f1 +0.3 over the untrained head",
    "primary_metric": "macro_f1",
    "min_improvement": 0.02,
}


def fill_hypothesis(study_yaml: Path) -> None:
    """Replace the TODO hypothesis of an init'ed study.yaml with a real one."""
    import yaml

    raw = yaml.safe_load(study_yaml.read_text())
    raw["hypothesis"] = dict(FILLED_HYPOTHESIS)
    study_yaml.write_text(yaml.safe_dump(raw, sort_keys=False))
