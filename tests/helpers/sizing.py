"""An extraction study for sizing on a given model folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

from helpers import write_extraction_study


def write_study(root: Path, model_dir: Path, evaluation: dict | None = None) -> Path:
    """A registered extraction study on the tiny Llama, with its data snapshot."""
    rng = random.Random(0)
    rows = []
    for i in range(30):
        who = rng.choice(["alice", "bob", "carol"])
        text = f"From: {who}@example.com\nSubject: s{i}\n\nMessage {i}: " + "word " * (i % 9)
        target = json.dumps({"sender": f"{who}@example.com", "subject": f"s{i}"})
        rows.append({"id": f"m{i}", "text": text, "target": target})
    training = {"micro_batch_size": 4, "max_steps": 4, "warmup_steps": 1, "num_threads": 1}
    return write_extraction_study(
        root, model_dir, "size-test", rows, training=training, evaluation=evaluation
    )
