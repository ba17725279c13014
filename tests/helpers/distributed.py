"""The distributed tests' shared pieces: their study, the CLI in a child process, and the run
folders a launch left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

BASE_SETS = ["training.micro_batch_size=2"]  # per rank; the single process takes 4


def email_rows(n: int = 32) -> list[dict]:
    rows = []
    for i in range(n):
        target = json.dumps({"sender": f"user{i}@example.com", "subject": f"Meeting {i}"})
        text = f"From: user{i}@example.com Subject: Meeting {i} " + "word " * (i % 5 * 3)
        rows.append({"text": text, "label": ["spam", "ham"][i % 2], "target": target})
    return rows


def write_distributed_study(root: Path, tiny_llama_dir: Path) -> Path:
    """The tiny Llama extraction study the distributed tests train (4 steps, micro 4 x 2,
    checkpoints at 2 and 4), with its data snapshot and registered hypothesis."""
    from tunelab.core.study import Study
    from tunelab.stages.data import stage as data_stage
    from tunelab.stages.hypothesis import stage as hypothesis_stage

    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in email_rows()))
    cfg = {
        "name": "distributed",
        "task": {
            "kind": "extraction",
            "instruction": "Extract the fields as a JSON object.",
            "json_schema": {"type": "object", "required": ["sender", "subject"]},
        },
        "hypothesis": {
            "behaviour": "b",
            "rationale": "r",
            "expected_effect": "e",
            "primary_metric": "field_micro_f1",
        },  # fmt: skip
        "guardrails": [{"metric": "json_valid_rate", "op": ">=", "value": 0.0}],
        "data": {
            "source": {"format": "jsonl", "path": "data.jsonl"},
            "fields": {"text": "text", "label": "label", "target": "target"},
            "dedup": {"near": False},
        },
        "model": {"path": str(tiny_llama_dir)},
        "preprocess": {"max_seq_len": 128},
        "training": {
            "micro_batch_size": 4,
            "grad_accum_steps": 2,
            "max_steps": 4,
            "lr": 0.01,
            "eval_every_steps": 2,
            "checkpoint_every_steps": 2,
            "num_threads": 1,
        },
    }
    (root / "study.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    study = Study.open(root)
    data_stage.run(study)
    hypothesis_stage.run(study.root, study.config)
    return root


def tunelab(*args: object, env: dict[str, str] | None = None, timeout: float = 240):
    """`python -m tunelab ARGS` in a child process, as a user runs it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tunelab", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def only_run_since(root: Path, before: set[str]) -> Path:
    new = sorted(set(os.listdir(root / "records" / "runs")) - before)
    assert len(new) == 1, new
    return root / "records" / "runs" / new[0]


def runs(root: Path) -> set[str]:
    folder = root / "records" / "runs"
    return set(os.listdir(folder)) if folder.exists() else set()
