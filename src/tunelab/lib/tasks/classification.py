"""Classification: the target is the label text.

Encoders predict through a classification head (the label index comes from
`Preprocessor.encode`); causal LMs answer with the label and are scored by the log-likelihood of
each label (`Preprocessor.encode_candidates`), so their answer is always inside the label set.
`parse` maps free text (a generated answer) to a label, for outputs produced another way.
"""

from __future__ import annotations

import re
from typing import Any

from tunelab.core.errors import DataError
from tunelab.lib.tasks.base import Task, failure

_TRIM = " \t\r\n\"'`.,;:!?()[]{}*"


class ClassificationTask(Task):
    kind = "classification"
    metric_names = ("accuracy", "macro_f1", "precision", "recall", "f1")

    def __init__(self, labels: list[str], instruction: str):
        super().__init__(list(labels), instruction)
        self.labels: list[str] = list(labels)
        self.label_to_index = {label: i for i, label in enumerate(self.labels)}

    @property
    def instruction(self) -> str:
        # The label set is part of the prompt so a causal LM knows the allowed answers.
        choices = "Answer with one of: " + ", ".join(self.labels) + "."
        return f"{self._instruction}\n{choices}" if self._instruction else choices

    def label_of(self, example: dict[str, Any]) -> str:
        label = example.get("label")
        if label is None or str(label) not in self.label_to_index:
            raise DataError(
                f"example {example.get('id')!r}: label {label!r} is not in the label set "
                f"{self.labels}",
                hint="add it to task.labels in study.yaml, or fix the example's label "
                "and rebuild the snapshot with `tunelab data`",
            )
        return str(label)

    def label_index(self, example: dict[str, Any]) -> int:
        return self.label_to_index[self.label_of(example)]

    def target_text(self, example: dict[str, Any]) -> str:
        return self.label_of(example)

    def parse(self, raw_output: str) -> dict[str, Any]:
        text = (raw_output or "").strip()
        if not text:
            return failure("empty", "the output is empty", label=None)
        first_line = text.splitlines()[0].strip(_TRIM)
        for candidate in (text.strip(_TRIM), first_line):
            if candidate in self.label_to_index:
                return self._ok(candidate)
            folded = {label.casefold(): label for label in self.labels}
            if candidate.casefold() in folded:
                return self._ok(folded[candidate.casefold()])
        # "sport, because ..." -> sport: the longest label the answer starts with, then a break.
        for label in sorted(self.labels, key=len, reverse=True):
            pattern = re.escape(label.casefold()) + r"(?![\w])"
            if re.match(pattern, first_line.casefold()):
                return self._ok(label)
        return failure("not_a_label", f"{text[:80]!r} is not one of {self.labels}", label=None)

    @staticmethod
    def _ok(label: str) -> dict[str, Any]:
        return {"valid": True, "failure": None, "error": None, "value": label, "label": label}

    def verdicts(self, parsed: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
        gold = self.label_of(example)
        return {
            "correct": parsed.get("label") == gold,
            "gold": gold,
            "predicted": parsed.get("label"),
        }
