"""Evaluation studies and examples on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.study import build_study
from tunelab.core.study import Study

TEXTS = [
    "Markets rallied as the central bank held interest rates steady.",
    "The striker scored twice in the second half to win the match.",
    "A new smartphone with a faster chip was announced.",
    "The film won the award.",
    "Parliament voted on the new budget after a long debate about taxes and spending plans.",
    "Quick brown fox.",
    "The match ended in a draw.",
]


LABELS = ["business", "sport", "tech"]


def make_study(root: Path, kind: str, model_dir: Path, **sections) -> Study:
    """A registered study of `kind` on a tiny model (no data snapshot)."""
    architecture = "encoder" if kind == "classification" else "causal_lm"
    fixed = {
        "model.architecture": architecture,
        "preprocess.max_seq_len": 96,
        "evaluation.batch_size": 3,
        "evaluation.max_new_tokens": 8,
    }
    build_study(
        root, kind, name="t", model_dir=model_dir, set=fixed, register=True, snapshot=False,
        **sections,
    )  # fmt: skip
    return Study.open(root)


def causal_classifier(root: Path, model_dir: Path, **sections) -> Study:
    """A registered classification study (LABELS) on a causal LM, which scores each label by
    its likelihood."""
    return make_study(
        root,
        "classification",
        model_dir,
        task={"labels": LABELS},
        model={"architecture": "causal_lm"},
        **sections,
    )


def cls_examples():
    return [
        {"id": f"e{i}", "text": t, "label": LABELS[i % 3], "target": None}
        for i, t in enumerate(TEXTS)
    ]


def load(study, labels=None):
    from tunelab.lib.models import load_model, load_tokenizer, resolve_base

    base = resolve_base(study)
    tok = load_tokenizer(base)
    return load_model(base, study.config, labels=labels), tok, base


def extraction_examples():
    out = []
    for i, t in enumerate(TEXTS[:5]):
        target = {"sender": f"user{i}@example.com", "subject": t[:20]}
        out.append(
            {
                "id": f"x{i}",
                "text": f"From: user{i}@example.com {t}",
                "label": None,
                "target": json.dumps(target),
            }
        )
    return out
