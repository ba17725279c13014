"""A tiny-BERT classification study, written and trained through the CLI (verify, export and smoke tests)."""

from __future__ import annotations

from pathlib import Path

from helpers import register_study, write_topic_study


def write_study(root: Path, model_dir: Path, **kw) -> Path:
    """A classification study on the tiny BERT with its data as JSONL (not registered)."""
    return write_topic_study(root, model_dir, "verify-test", **kw)


def trained_study(root: Path, model_dir: Path, **kw) -> tuple[Path, str]:
    """register -> data -> baseline -> train -> eval; returns (study dir, train run id)."""
    from tunelab.stages.evaluate.stage import run_baseline, run_eval
    from tunelab.stages.train import train_run

    write_study(root, model_dir, **kw)
    study = register_study(root)
    run_baseline(study)
    run = train_run(study, name="lora")
    run_eval(study, run.id)
    return root, run.id
