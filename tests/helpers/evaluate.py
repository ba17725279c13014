"""Evaluation studies and examples on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from helpers import filled_hypothesis
from tunelab.core.study import Study
from tunelab.stages.hypothesis import stage as hyp
from tunelab.stages.hypothesis.template import render_study_yaml

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
    raw = yaml.safe_load(render_study_yaml(kind, "t"))
    raw["hypothesis"] = filled_hypothesis(raw)
    raw["model"]["path"] = str(model_dir)
    raw["model"]["architecture"] = "encoder" if kind == "classification" else "causal_lm"
    raw["preprocess"]["max_seq_len"] = 96
    raw["evaluation"]["batch_size"] = 3
    raw["evaluation"]["max_new_tokens"] = 8
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    study = Study.open(root)
    hyp.run(study.root, study.config)
    return study


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
