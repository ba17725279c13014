"""An inspect study over given rows, task and preprocessing."""

from __future__ import annotations

from helpers import MINIMAL_HYPOTHESIS
from helpers.study import build_study


def write_study(root, model_dir, rows, task, preprocess=None, data=None):
    fields = {
        "text": "text",
        "label": "label",
        "target": "target" if task["kind"] != "classification" else None,
    }
    return build_study(
        root,
        template=False,
        name="inspect-test",
        hypothesis=MINIMAL_HYPOTHESIS,
        rows=rows,
        model_dir=model_dir,
        task=task,
        guardrails=[],
        set={"data.fields": fields, "data.dedup": {"near": False}},
        data=data or {},
        preprocess=preprocess or {},
    )
