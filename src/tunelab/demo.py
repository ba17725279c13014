"""`tunelab demo`: every stage of the protocol on a real model and real data, on CPU, in minutes.

The demo writes a real study (study.yaml pointing at the packaged assets), then runs each stage
as the user would: one `tunelab ...` command per stage, each in its own process, so what the demo
shows is exactly what the commands do. The dossier at the end is built from the records alone.

- classification (default): all-MiniLM-L6-v2 + a classification head, LoRA on query/value,
  BBC News topics; variant 2 changes one thing (the LoRA rank).
- extraction: SmolLM2-135M-Instruct + LoRA on all linear layers, SpamAssassin emails -> JSON
  {sender, subject, date, list}; variant 2 changes the learning rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tunelab import assets
from tunelab.demo_data import write_spam_extraction
from tunelab.errors import StudyError

DEMO_TASKS = ("classification", "extraction")


def classification_study(root: Path) -> dict[str, Any]:
    return {
        "name": "demo-bbc-topics",
        "task": {"kind": "classification", "instruction": "Classify the news article by topic."},
        "hypothesis": {
            "behaviour": "assign BBC news articles to one of five topics",
            "rationale": "MiniLM's sentence representations separate topics; a LoRA adapter and a trained "
            "head should map them to the five labels far better than the untrained head",
            "expected_effect": "macro_f1 +0.5 over the base model with its untrained head",
            "primary_metric": "macro_f1",
            "min_improvement": 0.05,
        },
        "guardrails": [
            {
                "metric": "f1",
                "scope": "every_category",
                "op": ">=",
                "value": -0.02,
                "relative_to": "baseline",
            },
            {"metric": "accuracy", "scope": "overall", "op": ">=", "value": 0.6},
        ],
        "data": {
            "source": {
                "format": "folder",
                "path": str(assets.bbc_path()),
                "glob": "*.txt",
                "encoding_errors": "replace",
            },
            "fields": {"text": "text", "label": "label"},
            "cleaning": [
                {"rule": "unicode_nfc"},
                {"rule": "normalize_whitespace"},
                {"rule": "drop_empty"},
            ],
            "splits": {"train": 0.7, "validation": 0.15, "test": 0.15, "seed": 0, "stratify": True},
            "dedup": {"exact": True, "near": True, "threshold": 0.8, "policy": "drop_eval"},
            "max_examples": 900,
        },
        "model": {
            "path": str(assets.minilm_path()),
            "name": "sentence-transformers/all-MiniLM-L6-v2",
            "architecture": "encoder",
        },
        "adaptation": {
            "method": "lora",
            "target_modules": ["query", "value"],
            "rank": 8,
            "alpha": 16,
            "dropout": 0.0,
            "modules_to_save": ["classifier"],
        },
        "preprocess": {"max_seq_len": 128, "truncation_side": "right"},
        "training": {
            "seed": 0,
            "micro_batch_size": 16,
            "grad_accum_steps": 1,
            "max_steps": 60,
            "lr": 2e-3,
            "schedule": "linear",
            "warmup_steps": 3,
            "eval_every_steps": 30,
            "checkpoint_every_steps": 30,
            "keep_last_checkpoints": 2,
        },
        "evaluation": {"split": "validation", "batch_size": 32},
        "budget": {
            "rental_days": 3,
            "gpu_hour_price": 2.5,
            "gpu": "1x H100 80GB",
            "num_variants": 4,
        },
    }


def extraction_study(root: Path) -> dict[str, Any]:
    data_file = write_spam_extraction(
        assets.spamassassin_path(), root / "data" / "emails.jsonl", 400
    )
    return {
        "name": "demo-email-fields",
        "task": {
            "kind": "extraction",
            "instruction": "Extract from the email a JSON object with: sender (the From address), subject, "
            "date (YYYY-MM-DD) and list (the List-Id, or null). Answer with the JSON only.",
            "json_schema": {
                "type": "object",
                "required": ["sender", "subject", "date", "list"],
                "properties": {
                    "sender": {"type": "string"},
                    "subject": {"type": "string"},
                    "date": {"type": "string"},
                    "list": {"type": ["string", "null"]},
                },
            },
        },
        "hypothesis": {
            "behaviour": "turn an email into a JSON record of its sender, subject, date and list",
            "rationale": "the base model rarely answers with the exact JSON; a LoRA adapter trained on "
            "header-derived targets teaches the format and the fields",
            "expected_effect": "field_micro_f1 +0.4 over the base model",
            "primary_metric": "field_micro_f1",
            "min_improvement": 0.05,
        },
        "guardrails": [
            {"metric": "json_valid_rate", "scope": "overall", "op": ">=", "value": 0.9},
            {
                "metric": "field_presence_rate",
                "scope": "every_field",
                "op": ">=",
                "value": -0.02,
                "relative_to": "baseline",
            },
        ],
        "data": {
            "source": {"format": "jsonl", "path": str(data_file.relative_to(root))},
            "fields": {"text": "text", "label": None, "target": "target"},
            "cleaning": [{"rule": "unicode_nfc"}, {"rule": "drop_empty"}],
            "splits": {"train": 0.8, "validation": 0.1, "test": 0.1, "seed": 0, "stratify": False},
            "dedup": {"exact": True, "near": True, "threshold": 0.9, "policy": "drop_eval"},
        },
        "model": {
            "path": str(assets.smollm2_gguf()[0]),
            "gguf_file": assets.smollm2_gguf()[1],
            "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "architecture": "causal_lm",
        },
        "adaptation": {
            "method": "lora",
            "target_modules": "all-linear",
            "rank": 8,
            "alpha": 16,
            "dropout": 0.0,
        },
        # evaluating, the prompt keeps max_seq_len - max_new_tokens = 192 tokens (the headers)
        "preprocess": {"max_seq_len": 288, "template": "chat", "truncation_side": "right"},
        "training": {
            "seed": 0,
            "micro_batch_size": 8,
            "grad_accum_steps": 1,
            "max_steps": 30,
            "lr": 1e-3,
            "schedule": "linear",
            "warmup_steps": 2,
            "eval_every_steps": 15,
            "checkpoint_every_steps": 15,
            "keep_last_checkpoints": 2,
        },
        "evaluation": {
            "split": "validation",
            "batch_size": 8,
            # the longest training answer with its EOS (64 would cut a fifth of them short)
            "max_new_tokens": 96,
            "max_examples": 20,
        },
        "budget": {
            "rental_days": 3,
            "gpu_hour_price": 2.5,
            "gpu": "1x H100 80GB",
            "num_variants": 4,
        },
    }


@dataclass
class Stage:
    title: str
    args: list[str]
    capture: str | None = None  # key under which the JSON result is kept


def _stages(task: str) -> list[Callable[[dict[str, Any]], Stage]]:
    variant_change = (
        ["--set", "adaptation.rank=16"]
        if task == "classification"
        else ["--set", "training.lr=2e-3"]
    )
    why = (
        "does a larger LoRA rank help?"
        if task == "classification"
        else "does a larger learning rate help?"
    )
    return [
        lambda r: Stage("register the hypothesis", ["register"]),
        lambda r: Stage("data snapshot", ["data"]),
        lambda r: Stage("inspect the preprocessing", ["inspect", "--per-category", "1"]),
        lambda r: Stage("baseline of the untouched model", ["baseline"]),
        lambda r: Stage("smoke: two steps, eval, fresh-process reload", ["smoke"]),
        lambda r: Stage("size a full training step", ["size"]),
        # planned from the initial check, before any experiment: the dossier sets it against
        # what the later stages took
        lambda r: Stage("rental plan", ["plan", "--days", "3"]),
        lambda r: Stage("train variant 1", ["train", "--name", "v1", "--json"], capture="v1"),
        lambda r: Stage(
            "train variant 2 (one change)",
            [
                "train",
                "--name",
                "v2",
                "--parent",
                r["v1"]["run_id"],
                "--why",
                why,
                *variant_change,
                "--json",
            ],
            capture="v2",
        ),
        lambda r: Stage("evaluate variant 1", ["eval", r["v1"]["run_id"]]),
        lambda r: Stage("evaluate variant 2", ["eval", r["v2"]["run_id"]]),
        lambda r: Stage("compare with guardrails", ["compare"]),
        lambda r: Stage("verify variant 1 in a fresh process", ["verify", r["v1"]["run_id"]]),
        lambda r: Stage("export variant 1 bound to its base", ["export", r["v1"]["run_id"]]),
        lambda r: Stage("dossier", ["report"]),
    ]


def _run_stage(stage: Stage, study: Path, log: Callable[[str], None]) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "tunelab", *stage.args[:1], "--study", str(study), *stage.args[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if stage.capture is None:
        proc = subprocess.run(cmd, env=env)
        out = None
    else:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        out = proc.stdout
    if proc.returncode != 0:
        raise StudyError(
            f"demo stage '{stage.title}' failed (exit {proc.returncode}): {' '.join(cmd[2:])}",
            hint=f"the study is in {study}; rerun that command to see the error",
        )
    if out is not None:
        start = out.find("{")
        return json.loads(out[start:]) if start >= 0 else None
    return None


def run_demo(task: str, directory: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Create the study in `directory` and run every stage; returns durations and the dossier path."""
    if task not in DEMO_TASKS:
        raise StudyError(
            f"unknown demo task {task!r}", hint=f"choose one of {', '.join(DEMO_TASKS)}"
        )
    directory = Path(directory)
    if (directory / "study.yaml").exists():
        raise StudyError(f"{directory} already holds a study", hint="pass --dir to a new folder")
    directory.mkdir(parents=True, exist_ok=True)
    study = (classification_study if task == "classification" else extraction_study)(directory)
    (directory / "study.yaml").write_text(
        "# Written by `tunelab demo`: a real study on packaged assets.\n"
        + yaml.safe_dump(study, sort_keys=False)
    )
    results: dict[str, Any] = {}
    timings = []
    t_all = time.perf_counter()
    for make in _stages(task):
        stage = make(results)
        log(f"\n=== {stage.title}: tunelab {' '.join(stage.args)}")
        t0 = time.perf_counter()
        out = _run_stage(stage, directory, log)
        if stage.capture:
            results[stage.capture] = out
        timings.append((stage.title, time.perf_counter() - t0))
    return {
        "study": str(directory),
        "dossier": str(directory / "report" / "dossier.html"),
        "timings_s": timings,
        "total_s": time.perf_counter() - t_all,
        "runs": results,
    }
