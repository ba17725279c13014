"""An inspect study over given rows, task and preprocessing."""

from __future__ import annotations

import yaml


def write_study(root, model_dir, rows, task, preprocess=None, data=None):
    import json

    root.mkdir(parents=True)
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "name": "inspect-test",
        "task": task,
        "hypothesis": {
            "behaviour": "b",
            "rationale": "r",
            "expected_effect": "e",
            "primary_metric": "macro_f1",
        },
        "guardrails": [],
        "data": {
            "source": {"format": "jsonl", "path": "data.jsonl"},
            "fields": {
                "text": "text",
                "label": "label",
                "target": "target" if task["kind"] != "classification" else None,
            },
            "dedup": {"near": False},
            **(data or {}),
        },
        "model": {"path": str(model_dir)},
        "preprocess": preprocess or {},
    }
    (root / "study.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root
