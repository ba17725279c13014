"""Preprocessing builders shared by the preprocessing and chat-template tests: a validated config
of one task kind, its `Preprocessor`, an extraction example and the text under the loss."""

from __future__ import annotations

import yaml

from tunelab.core.config import validate_config
from tunelab.lib.preprocess.mask_checks import IGNORE_INDEX
from tunelab.lib.preprocess.text import Preprocessor
from tunelab.lib.tasks import get_task
from tunelab.stages.hypothesis.template import render_study_yaml

TARGET = '{"sender": "bob@example.org", "subject": "Re: your account"}'
MAIL = "From: bob@example.org Subject: Re: your account Date: Thu, 22 Aug 2002 12:00:00 +0000"


def make_cfg(kind: str, preprocess: dict | None = None, **task):
    """The `tunelab init` config of `kind`, its task and preprocess sections updated."""
    raw = yaml.safe_load(render_study_yaml(kind, "t"))
    raw["task"].update(task)
    raw["preprocess"].update(preprocess or {})
    return validate_config(raw)


def make_pre(tok, kind="extraction", arch="causal_lm", labels=None, preprocess=None, **task):
    cfg = make_cfg(kind, preprocess, **task)
    return Preprocessor(tok, cfg, get_task(cfg, labels), arch)


def ex(i=0, text=MAIL, target=TARGET, label=None):
    return {"id": f"ex-{i}", "text": text, "label": label, "target": target}


def loss_text(tok, enc):
    """The tokens under the loss, decoded."""
    return tok.decode(
        [t for t, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != IGNORE_INDEX]
    )
