"""Image classification: the target is the label of an image.

Scored exactly as text classification (per-category precision, recall, F1, the confusion
matrix), so `kind` stays "classification" for the metrics, guardrails and compare; `modality`
tells the stages that read inputs (preprocessing, inspect) that an example is an image.

`ImageClassificationTask` is a `ClassificationTask` with `modality = "image"`.
"""

from __future__ import annotations

from tunelab.lib.tasks.classification import ClassificationTask


class ImageClassificationTask(ClassificationTask):
    modality = "image"
