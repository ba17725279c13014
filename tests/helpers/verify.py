"""A tiny-BERT classification study, written and trained through the CLI (verify, export and smoke tests)."""

from __future__ import annotations

from pathlib import Path

from helpers import register_study, write_topic_study


def write_study(root: Path, model_dir: Path, **kw) -> Path:
    """A classification study on the tiny BERT with its data as JSONL (not registered)."""
    return write_topic_study(root, model_dir, "verify-test", **kw)


def trained_study(root: Path, model_dir: Path, **kw) -> tuple[Path, str]:
    """register -> data -> baseline -> train -> eval; returns (study dir, train run id)."""
    from tunelab.stages.evaluate import stage as evaluate_stage
    from tunelab.stages.train import stage as train_stage

    write_study(root, model_dir, **kw)
    study = register_study(root)
    evaluate_stage.run(study)
    run = train_stage.run(study, name="lora")
    evaluate_stage.run(study, run.id)
    return root, run.id
