"""Ticket-like rows and JSONL studies for the data stage."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tunelab.core.study import Study

LABELS = ["billing", "outage", "sales"]


WORDS = (
    "account invoice refund network router latency contract upgrade discount customer server "
    "backup payment password delivery warranty modem fiber cable license quota storage report"
).split()


def ticket(i: int, label: str, n_words: int = 30) -> str:
    rnd = random.Random(i)
    return f"ticket {i} about {label}: " + " ".join(rnd.choice(WORDS) for _ in range(n_words))


def make_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"text": ticket(i, LABELS[i % 3]), "label": LABELS[i % 3]} for i in range(start, start + n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TICKETS_HYPOTHESIS = {
    "behaviour": "route tickets",
    "rationale": "r",
    "expected_effect": "e",
    "primary_metric": "macro_f1",
}


def make_study(root: Path, data: dict, task: dict | None = None) -> Study:
    """A study of only a data section (and a task): what the data stage reads."""
    from helpers.study import build_study

    sections = {"guardrails": [], "data": data, "model": {"path": "unused"}}
    build_study(
        root,
        template=False,
        name="data-test",
        hypothesis=TICKETS_HYPOTHESIS,
        **sections,
        **({"task": task} if task else {}),
    )
    return Study.open(root)


def jsonl_study(tmp_path: Path, rows: list[dict], **data: object) -> Study:
    write_jsonl(tmp_path / "s" / "data" / "rows.jsonl", rows)
    return make_study(
        tmp_path / "s", {"source": {"format": "jsonl", "path": "data/rows.jsonl"}, **data}
    )
