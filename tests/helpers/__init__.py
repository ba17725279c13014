"""Helpers for tests: run the CLI in-process, write small studies."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

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


# the least a hypothesis needs, for tests of what is not the hypothesis
MINIMAL_HYPOTHESIS = {
    "behaviour": "b",
    "rationale": "r",
    "expected_effect": "e",
    "primary_metric": "macro_f1",
}

FILLED_HYPOTHESIS = {
    "behaviour": "route BBC articles to their topic",
    "rationale": "the encoder was not trained on these five topics",
    "expected_effect": "macro_f1 +0.3 over the untrained head",
    "primary_metric": "macro_f1",
    "min_improvement": 0.02,
}


def filled_hypothesis(raw: dict[str, Any]) -> dict[str, Any]:
    """FILLED_HYPOTHESIS with the primary metric of `raw`'s template, one its task records."""
    return {**FILLED_HYPOTHESIS, "primary_metric": raw["hypothesis"]["primary_metric"]}


def fill_hypothesis(study_yaml: Path) -> None:
    """Replace the TODO hypothesis of an init'ed study.yaml with a real one."""
    import yaml

    raw = yaml.safe_load(study_yaml.read_text())
    raw["hypothesis"] = filled_hypothesis(raw)
    study_yaml.write_text(yaml.safe_dump(raw, sort_keys=False))


# ------------------------------------------------------------------ small studies


def register_study(root: Path, *, snapshot: bool = True) -> Any:
    """Open the study.yaml written under root, register its hypothesis and (unless told not to)
    build its data snapshot; returns the Study."""
    from tunelab.core.study import Study
    from tunelab.stages.data import stage as data_stage
    from tunelab.stages.hypothesis import stage as hyp

    study = Study.open(root)
    hyp.run(study.root, study.config)
    if snapshot:
        data_stage.run(study)
    return study


def write_extraction_study(
    root: Path,
    model_dir: Path,
    name: str,
    rows: list[dict[str, Any]],
    *,
    training: dict[str, Any],
    adaptation: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
) -> Path:
    """A registered extraction study (sender, subject) on the tiny Llama with its data snapshot:
    rows as mail.jsonl, LoRA on q_proj and v_proj, sequences of 128 tokens (`evaluation`: its
    settings over the template's)."""
    from helpers.study import build_study

    return build_study(
        root,
        "extraction",
        name=name,
        model_dir=model_dir,
        rows=rows,
        data_file="mail.jsonl",
        set={"data.fields": EXTRACTION_FIELDS, "data.cleaning": [], "preprocess.max_seq_len": 128},
        adaptation={"target_modules": ["q_proj", "v_proj"], **(adaptation or {})},
        training=training,
        register=True,
        **({"evaluation": evaluation} if evaluation else {}),
    )


EXTRACTION_FIELDS = {"id": "id", "text": "text", "label": None, "target": "target"}


def write_email_study(
    root: Path,
    model_dir: Path,
    name: str,
    *,
    max_steps: int,
    eval_every_steps: int,
    checkpoint_every_steps: int,
    adaptation: dict[str, Any] | None = None,
    **training: Any,
) -> Path:
    """The study of the training and kill tests: 40 seeded emails (8 senders, 4 subjects),
    LoRA dropout 0.1 (so resuming must restore the RNG), micro-batch 2 x 2, cosine schedule,
    one thread. `adaptation` updates the adaptation section (`{"method": "qlora", ...}`)."""
    rng = random.Random(0)
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    subjects = ["Meeting tomorrow", "Re: your account", "Budget", "Lunch on Friday"]
    rows = []
    for i in range(40):
        sender, subject = rng.choice(names), rng.choice(subjects)
        text = f"From: {sender}@example.com\nSubject: {subject}\n\nMessage {i}: " + "word " * (
            i % 7
        )
        target = json.dumps({"sender": f"{sender}@example.com", "subject": subject})
        rows.append({"id": f"m{i}", "text": text, "target": target})
    return write_extraction_study(
        root,
        model_dir,
        name,
        rows,
        adaptation={"dropout": 0.1, **(adaptation or {})},
        training={
            "micro_batch_size": 2,
            "grad_accum_steps": 2,
            "max_steps": max_steps,
            "lr": 2e-2,
            "warmup_steps": 2,
            "schedule": "cosine",
            "eval_every_steps": eval_every_steps,
            "checkpoint_every_steps": checkpoint_every_steps,
            "keep_last_checkpoints": 2,
            "num_threads": 1,
            **training,
        },
    )


TOPIC_LABELS = ["business", "sport", "tech"]
TOPIC_TEXTS = {
    "business": [
        "Markets rallied as the central bank held interest rates steady",
        "Shares fell after the company reported lower profits this quarter",
        "The bank raised its forecast for growth and inflation next year",
        "Oil prices climbed as traders bet on stronger demand",
        "The retailer cut jobs after sales dropped over the holidays",
        "Investors sold bonds as the budget deficit widened",
    ],
    "sport": [
        "The striker scored twice in the second half to win the match",
        "The team lost the final after extra time and penalties",
        "The champion won the race by two seconds on a wet track",
        "The coach praised the defence after a clean sheet at home",
        "The keeper saved a late penalty to secure the draw",
        "The club signed a young winger before the transfer deadline",
    ],
    "tech": [
        "A new smartphone with a faster chip and longer battery life was announced",
        "The software update fixes a security flaw in the browser",
        "Researchers built a robot that learns to sort parcels",
        "The chip maker unveiled a processor for laptops and servers",
        "The social network changed how it ranks posts in the feed",
        "Engineers tested a battery that charges in five minutes",
    ],
}


def write_topic_study(
    root: Path,
    model_path: Path | str,
    name: str,
    *,
    method: str = "lora",
    max_steps: int = 4,
    **sections: dict[str, Any],
) -> Path:
    """A classification study (business, sport, tech) on the tiny BERT with its data as JSONL in
    the user's own split: 8 train, 3 validation, 1 test per label. Not registered; `sections`
    update the config's sections last."""
    from helpers.study import build_study

    rows = []
    for label, texts in TOPIC_TEXTS.items():
        variants = texts + [f"{t} today" for t in texts]
        for i, text in enumerate(variants[:12]):
            split = "train" if i < 8 else "validation" if i < 11 else "test"
            rows.append({"id": f"{label[:3]}{i}", "text": text, "label": label, "split": split})
    fixed = {
        "task.labels": TOPIC_LABELS,
        "model.architecture": "encoder",
        "adaptation.method": method,
        "adaptation.target_modules": ["query", "value"],
        "preprocess.max_seq_len": 32,
        "evaluation.batch_size": 4,
        "evaluation.bootstrap_samples": 50,
    }
    training = {
        "micro_batch_size": 4,
        "max_steps": max_steps,
        "lr": 5e-3,
        "warmup_steps": 0,
        "eval_every_steps": None,
        "checkpoint_every_steps": None,
    }
    fixed |= {f"training.{k}": v for k, v in training.items()}
    return build_study(
        root, "classification", name=name, model_dir=model_path, rows=rows, set=fixed, **sections
    )


def write_config_only_study(
    root: Path, model_config: dict[str, Any], capsys: pytest.CaptureFixture[str], **model: Any
) -> Path:
    """An extraction study whose base is only a config.json (no weights), 200 emails of
    varied length, micro-batch 4 x 4, 3 epochs, sequences of 1,024: registered, with its data
    snapshot (no model is needed for either). `model` updates the model section."""
    from helpers.study import build_study

    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps(model_config))
    rows = [
        {
            "id": f"m{i}",
            "text": f"From: user{i}@example.com\nSubject: note {i}\n\n" + "text " * (i % 40),
            "target": json.dumps({"sender": f"user{i}@example.com", "subject": f"note {i}"}),
        }
        for i in range(200)
    ]
    build_study(
        root,
        "extraction",
        name=root.name,
        model_dir="model",
        rows=rows,
        data_file="mail.jsonl",
        hypothesis={**FILLED_HYPOTHESIS, "primary_metric": "field_micro_f1"},
        set={"data.fields": EXTRACTION_FIELDS, "preprocess.max_seq_len": 1024},
        model=model,
        training={"micro_batch_size": 4, "grad_accum_steps": 4, "max_steps": None, "num_epochs": 3},
    )
    for command in ("register", "data"):
        code, _, err = run_cli(capsys, command, "-s", root)
        assert code == 0, err
    return root


# ------------------------------------------------------------------ kill harness fixtures


def train_stopped_at(study: Any, step: int, name: str, **kwargs: Any) -> Any:
    """`train_stage.run` stopped by SIGTERM at `step` (the loop's test hook): the interrupted run."""
    import os

    from tunelab.stages.train import RunInterrupted
    from tunelab.stages.train import stage as train_stage

    os.environ["TUNELAB_TEST_KILL_AT"] = f"term:{step}"
    try:
        with pytest.raises(RunInterrupted):
            train_stage.run(study, name=name, **kwargs)
    finally:
        del os.environ["TUNELAB_TEST_KILL_AT"]
    (stopped,) = [r for r in study.ledger.list_runs() if r.name == name]
    return stopped


def kill_harness_fixtures(tag: str, *, steps: int, checkpoint_every: int) -> tuple[Any, Any]:
    """The module-scoped `launcher` and `study_dir` fixtures of a test on tests/stress/harness.py
    (which must be importable: tests/stress on sys.path). Use as
    `launcher, study_dir = kill_harness_fixtures("kill", steps=12, checkpoint_every=3)`."""

    @pytest.fixture(scope="module")
    def launcher(tmp_path_factory):
        import harness

        return harness.Launcher(tmp_path_factory.mktemp(f"{tag}-logs"))

    @pytest.fixture(scope="module")
    def study_dir(tmp_path_factory, tiny_llama_dir) -> Path:
        import harness

        return harness.write_study(
            tmp_path_factory.mktemp(tag) / "s",
            tiny_llama_dir,
            steps=steps,
            checkpoint_every=checkpoint_every,
        )

    return launcher, study_dir
